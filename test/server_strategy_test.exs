defmodule LlamaCppEx.Server.StrategyTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.Server.Slots

  alias LlamaCppEx.Server.Strategy.{
    Balanced,
    DecodeMaximal,
    Fair,
    LatencyFirst,
    PrefillPriority,
    ThroughputFirst
  }

  defp slot(fields) do
    base = %{
      state: :idle,
      prompt_tokens: [],
      prompt_tokens_tuple: {},
      n_prompt_tokens: 0,
      prefill_pos: 0,
      pos: 0,
      pending_token: nil,
      pending_eog: false,
      batch_idx: -1,
      generated_token_ids: [],
      t_start: 0,
      cached_tokens: [],
      t_last_used: 0
    }

    Map.merge(base, Map.new(fields))
  end

  defp prefilling(n, t_start \\ 0) do
    tokens = Enum.to_list(1000..(1000 + n - 1))

    slot(
      state: :prefilling,
      prompt_tokens: tokens,
      prompt_tokens_tuple: List.to_tuple(tokens),
      n_prompt_tokens: n,
      t_start: t_start
    )
  end

  defp generating(token, pos),
    do: slot(state: :generating, pending_token: token, pos: pos, n_prompt_tokens: pos)

  defp seqs({entries, _}), do: Enum.map(entries, &elem(&1, 2))

  test "the distinguishing batch orders" do
    slots = %{
      0 => prefilling(100),
      1 => generating(11, 5),
      2 => generating(12, 5),
      3 => generating(13, 5),
      4 => generating(14, 5)
    }

    assert seqs(DecodeMaximal.build_batch(slots, 4, 512, [])) == [1, 2, 3, 4]
    assert seqs(Balanced.build_batch(slots, 4, 512, [])) == [1, 2, 0, 0]
    assert seqs(PrefillPriority.build_batch(slots, 4, 512, [])) == [0, 0, 0, 0]
  end

  test "decode-first and prefill-first orders with one slot each" do
    slots = %{0 => prefilling(5), 1 => generating(12, 2)}
    {entries, updated} = DecodeMaximal.build_batch(slots, 100, 512, [])
    assert Enum.map(entries, &elem(&1, 2)) == [1, 0, 0, 0, 0, 0]
    assert hd(entries) == {12, 2, 1, true}
    assert updated[1].batch_idx == 0
    assert updated[1].generated_token_ids == [12]
    assert updated[0].batch_idx == 5
    assert updated[0].prefill_pos == 5
    assert List.last(entries) == {1004, 4, 0, true}

    {entries, _} = PrefillPriority.build_batch(slots, 100, 512, [])
    assert Enum.map(entries, &elem(&1, 2)) == [0, 0, 0, 0, 0, 1]
    assert List.last(entries) == {12, 2, 1, true}
  end

  test "chunks respect chunk_size and only the completing chunk asks for logits" do
    slots = %{0 => prefilling(10)}
    {entries, s} = DecodeMaximal.build_batch(slots, 100, 4, [])
    assert length(entries) == 4
    refute Enum.any?(entries, &elem(&1, 3))
    assert s[0].prefill_pos == 4 and s[0].batch_idx == -1
    {entries, s} = DecodeMaximal.build_batch(%{0 => %{s[0] | prefill_pos: 8}}, 100, 4, [])
    assert [{_, 8, 0, false}, {_, 9, 0, true}] = entries
    assert s[0].batch_idx == 1
  end

  test "a zero budget adds nothing" do
    slots = %{1 => generating(3, 1)}
    assert {[], ^slots} = DecodeMaximal.build_batch(slots, 0, 512, [])
  end

  test "Fair rotates which slot decodes first" do
    slots = %{0 => generating(10, 1), 1 => generating(11, 1), 2 => generating(12, 1)}
    assert seqs(Fair.build_batch(slots, 2, 512, tick: 0)) == [0, 1]
    assert seqs(Fair.build_batch(slots, 2, 512, tick: 1)) == [1, 2]
    assert seqs(Fair.build_batch(slots, 2, 512, tick: 2)) == [2, 0]
  end

  test "LatencyFirst prefills the youngest request first" do
    slots = %{0 => prefilling(3, 100), 1 => prefilling(3, 200), 2 => generating(9, 4)}
    assert seqs(LatencyFirst.build_batch(slots, 4, 512, [])) == [1, 1, 1, 0]
  end

  test "ThroughputFirst serves the longest sequences first" do
    slots = %{
      0 => generating(1, 10),
      1 => generating(2, 50),
      2 => prefilling(2),
      3 => prefilling(6)
    }

    assert seqs(ThroughputFirst.build_batch(slots, 5, 512, [])) == [1, 0, 3, 3, 3]
  end

  test "slot selection helpers" do
    assert Slots.common_prefix_length([1, 2, 3], [1, 2, 4]) == 2

    idle = [
      {0, slot(cached_tokens: [1, 2, 3, 4], t_last_used: 5)},
      {1, slot(cached_tokens: [9], t_last_used: 1)}
    ]

    assert Slots.pick_cached_slot(idle, [1, 2, 3, 4, 5, 6]) == {0, 4}
    # exactly 10% is not enough
    assert Slots.pick_cached_slot(idle, [1 | Enum.to_list(100..108)]) == {1, 0}
    assert Slots.pick_cached_slot(idle, []) == {1, 0}
    assert Slots.pick_cached_slot([], [1]) == nil
    assert Slots.pick_lru_slot(idle) == 1
    assert Slots.session_slot_if_idle(%{{nil, "a"} => 1}, {nil, "a"}, idle) == 1
    assert Slots.session_slot_if_idle(%{{nil, "a"} => 1}, {"tenant", "a"}, idle) == nil

    gen = %{
      state: :generating,
      prompt_tokens: [1, 2, 3],
      n_prompt_tokens: 3,
      generated_token_ids: [5, 4],
      pos: 5
    }

    assert Slots.donor_prefix_match(gen, [1, 2, 3, 4, 5, 6]) == 5
    assert Slots.donor_prefix_match(gen, [1, 2, 9]) == 2
    assert Slots.prefix_usable?(808, 799, 512)
    refute Slots.prefix_usable?(808, 299, 512)
    assert Slots.prefix_usable?(100_000, 5, 0)

    pre = %{state: :prefilling, prompt_tokens: [1, 2, 3, 4], prefill_pos: 2}
    assert Slots.donor_prefix_match(pre, [1, 2, 3, 4]) == 2
  end
end
