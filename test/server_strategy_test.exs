defmodule LlamaCppEx.Server.StrategyTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.Server.{Placement, Plan, Slot}

  alias LlamaCppEx.Server.Strategy.{
    Balanced,
    DecodeMaximal,
    Fair,
    LatencyFirst,
    PrefillPriority,
    ThroughputFirst
  }

  defp request(t_start), do: LlamaCppEx.ServerFixtures.request([1], t_start: t_start)

  defp prefilling(n, t_start \\ 0) do
    tokens = Enum.to_list(1000..(1000 + n - 1))

    %Slot{
      state: :prefilling,
      request: request(t_start),
      prompt: List.to_tuple(tokens),
      n_prompt: n
    }
  end

  defp generating(token, pos),
    do: %Slot{state: :generating, request: request(0), pending: token, pos: pos, n_prompt: pos}

  # What the server does with a strategy's plan: check it, then build the step's entries.
  defp build(strategy, slots, budget, chunk_size, opts) do
    plan = Plan.of(strategy, slots, budget, chunk_size, opts, make_ref())

    {step, updated, _counts} = Plan.to_step(plan, slots)
    {step.entries, updated}
  end

  defp seqs(strategy, slots, budget, chunk_size \\ 512, opts \\ []),
    do: strategy |> build(slots, budget, chunk_size, opts) |> elem(0) |> Enum.map(&elem(&1, 2))

  test "the distinguishing batch orders" do
    slots = %{
      0 => prefilling(100),
      1 => generating(11, 5),
      2 => generating(12, 5),
      3 => generating(13, 5),
      4 => generating(14, 5)
    }

    assert seqs(DecodeMaximal, slots, 4) == [1, 2, 3, 4]
    assert seqs(Balanced, slots, 4) == [1, 2, 0, 0]
    assert seqs(PrefillPriority, slots, 4) == [0, 0, 0, 0]
  end

  test "decode-first and prefill-first orders with one slot each" do
    slots = %{0 => prefilling(5), 1 => generating(12, 2)}
    {entries, updated} = build(DecodeMaximal, slots, 100, 512, [])
    assert Enum.map(entries, &elem(&1, 2)) == [1, 0, 0, 0, 0, 0]
    assert hd(entries) == {12, 2, 1, true}
    assert updated[1].fed == [12] and updated[1].pending == nil
    assert updated[0].prefill_pos == 5
    assert List.last(entries) == {1004, 4, 0, true}

    {entries, _} = build(PrefillPriority, slots, 100, 512, [])
    assert Enum.map(entries, &elem(&1, 2)) == [0, 0, 0, 0, 0, 1]
    assert List.last(entries) == {12, 2, 1, true}
  end

  test "chunks respect chunk_size and only the completing chunk asks for logits" do
    slots = %{0 => prefilling(10)}
    {entries, s} = build(DecodeMaximal, slots, 100, 4, [])
    assert length(entries) == 4
    refute Enum.any?(entries, &elem(&1, 3))
    assert s[0].prefill_pos == 4
    {entries, s} = build(DecodeMaximal, %{0 => %{s[0] | prefill_pos: 8}}, 100, 4, [])
    assert [{_, 8, 0, false}, {_, 9, 0, true}] = entries
    assert s[0].prefill_pos == 10
  end

  test "a zero budget adds nothing" do
    slots = %{1 => generating(3, 1)}
    assert {[], ^slots} = build(DecodeMaximal, slots, 0, 512, [])
  end

  test "Fair rotates which slot decodes first" do
    slots = %{0 => generating(10, 1), 1 => generating(11, 1), 2 => generating(12, 1)}
    assert seqs(Fair, slots, 2, 512, tick: 0) == [0, 1]
    assert seqs(Fair, slots, 2, 512, tick: 1) == [1, 2]
    assert seqs(Fair, slots, 2, 512, tick: 2) == [2, 0]
  end

  test "LatencyFirst prefills the youngest request first" do
    slots = %{0 => prefilling(3, 100), 1 => prefilling(3, 200), 2 => generating(9, 4)}
    assert seqs(LatencyFirst, slots, 4) == [1, 1, 1, 0]
  end

  test "ThroughputFirst serves the longest sequences first" do
    slots = %{
      0 => generating(1, 10),
      1 => generating(2, 50),
      2 => prefilling(2),
      3 => prefilling(6)
    }

    assert seqs(ThroughputFirst, slots, 5) == [1, 0, 3, 3, 3]
  end

  defmodule Broken do
    def plan(_slots, _budget, _chunk, opts), do: Keyword.fetch!(opts, :plan)
  end

  test "a malformed plan raises an error naming the strategy and what it returned" do
    slots = %{0 => prefilling(5), 1 => generating(12, 2)}

    for {plan, why} <- [
          {:nope, "not a list"},
          {[{:decode, 0}], "no token to decode"},
          {[{:decode, 1}, {:decode, 1}], "appears twice"},
          {[{:prefill, 0, 6}], "does not fit"},
          {[{:prefill, 7, 1}], "no slot 7"},
          {[{:prefill, 0, 5}, {:decode, 1}], "exceed the budget"},
          {[:other], "unknown item"}
        ] do
      err =
        assert_raise ArgumentError, fn ->
          build(Broken, slots, 5, 512, plan: plan)
        end

      assert err.message =~ "LlamaCppEx.Server.StrategyTest.Broken.plan/4"
      assert err.message =~ why
    end
  end

  describe "the contract's shape (slot maps in, {entries, slots} out)" do
    alias LlamaCppEx.Test.ContractStrategies, as: C

    test "built-in strategies answer contract callers: the distinguishing batch orders" do
      slots = %{
        0 => C.prefilling(Enum.to_list(1000..1099)),
        1 => C.generating(11, 5),
        2 => C.generating(12, 5),
        3 => C.generating(13, 5),
        4 => C.generating(14, 5)
      }

      ids = fn strategy ->
        {entries, _} = strategy.build_batch(slots, 4, 512, model_ref: nil, queue_depth: 0)
        Enum.map(entries, &elem(&1, 2))
      end

      assert ids.(DecodeMaximal) == [1, 2, 3, 4]
      assert ids.(Balanced) == [1, 2, 0, 0]
      assert ids.(PrefillPriority) == [0, 0, 0, 0]
    end

    test "decode-first and prefill-first with one slot each, and the updated slots" do
      slots = %{0 => C.prefilling([1000, 1001, 1002, 1003, 1004]), 1 => C.generating(12, 2)}
      {entries, updated} = DecodeMaximal.build_batch(slots, 100, 512, [])
      assert Enum.map(entries, &elem(&1, 2)) == [1, 0, 0, 0, 0, 0]
      assert hd(entries) == {12, 2, 1, true}
      assert updated[1].batch_idx == 0 and updated[1].generated_token_ids == [12]
      assert updated[0].prefill_pos == 5 and updated[0].batch_idx == 5

      {entries, _} = PrefillPriority.build_batch(slots, 100, 512, [])
      assert Enum.map(entries, &elem(&1, 2)) == [0, 0, 0, 0, 0, 1]
      assert List.last(entries) == {12, 2, 1, true}
    end

    test "the helpers: chunks, logits only on the completing token, no budget adds nothing" do
      alias LlamaCppEx.Server.Strategy.Batch
      slots = %{0 => C.prefilling(Enum.to_list(1..10)), 1 => C.generating(7, 3)}
      {es, 4, s, 0} = Batch.add_prefill_chunks(slots, [], 0, 4, 512)

      assert Enum.reverse(es) == [
               {1, 0, 0, false},
               {2, 1, 0, false},
               {3, 2, 0, false},
               {4, 3, 0, false}
             ]

      assert s[0].prefill_pos == 4 and s[0].batch_idx == -1
      {es, 2, s, _} = Batch.add_prefill_chunks(%{0 => %{s[0] | prefill_pos: 8}}, [], 0, 9, 4)
      assert Enum.reverse(es) == [{9, 8, 0, false}, {10, 9, 0, true}]
      assert s[0].batch_idx == 1
      assert {[], 0, ^slots, 0} = Batch.add_decode_tokens(slots, [], 0, 0)
    end

    test "strategies written to the contract run here with the built-ins' batches" do
      slots = %{0 => prefilling(7), 1 => generating(12, 2), 2 => generating(13, 9)}

      for budget <- [1, 3, 100], chunk <- [2, 512] do
        assert build(C.GreedyDecodeFirst, slots, budget, chunk, []) ==
                 build(DecodeMaximal, slots, budget, chunk, [])

        assert build(C.PrefillFirst, slots, budget, chunk, []) ==
                 build(PrefillPriority, slots, budget, chunk, [])
      end

      # round robin interleaves sequences; each one's tokens stay in order
      {entries, updated} = build(C.RoundRobin, slots, 5, 512, [])
      assert Enum.sort(Enum.map(entries, &elem(&1, 2))) == [0, 0, 0, 1, 2]
      assert updated[0].prefill_pos == 3 and updated[1].pending == nil
    end

    defmodule Answers do
      @moduledoc false
      def build_batch(_slots, _budget, _chunk, opts), do: Keyword.fetch!(opts, :answer)
    end

    test "a wrong answer raises an error naming the strategy and what it returned" do
      slots = %{0 => prefilling(5), 1 => generating(12, 2)}

      for {answer, why} <- [
            {:nope, "expected {entries, slots}"},
            {{[:x], %{}}, "not {token, pos, seq_id, logits?}"},
            {{[{1000, 0, 0, false}, {5, 1, 0, false}], %{}}, "not slot 0's next prompt tokens"},
            {{[{1000, 0, 0, true}], %{}}, "not slot 0's next prompt tokens"},
            {{[{99, 2, 1, true}], %{}}, "not what slot 1 feeds next"},
            {{[{12, 2, 1, true}, {12, 2, 1, true}], %{}}, "not what slot 1 feeds next"},
            {{[{1, 0, 7, true}], %{}}, "no slot 7"},
            {{Enum.map(0..4, &{1000 + &1, &1, 0, &1 == 4}) ++ [{12, 2, 1, true}], %{}},
             "exceed the budget"}
          ] do
        err = assert_raise ArgumentError, fn -> build(Answers, slots, 5, 512, answer: answer) end
        assert err.message =~ "LlamaCppEx.Server.StrategyTest.Answers.build_batch/4"
        assert err.message =~ why
      end
    end
  end

  test "slot selection helpers" do
    assert Placement.common_prefix_length([1, 2, 3], [1, 2, 4]) == 2

    idle = [
      {0, %Slot{cached: [1, 2, 3, 4], t_last_used: 5}},
      {1, %Slot{cached: [9], t_last_used: 1}}
    ]

    assert Placement.pick_cached_slot(idle, [1, 2, 3, 4, 5, 6]) == {0, 4}
    # exactly 10% is not enough
    assert Placement.pick_cached_slot(idle, [1 | Enum.to_list(100..108)]) == {1, 0}
    assert Placement.pick_cached_slot(idle, []) == {1, 0}
    assert Placement.pick_cached_slot([], [1]) == nil
    assert Placement.pick_lru_slot(idle) == 1
    assert Placement.session_slot_if_idle(%{{nil, "a"} => 1}, {nil, "a"}, idle) == 1
    assert Placement.session_slot_if_idle(%{{nil, "a"} => 1}, {"tenant", "a"}, idle) == nil

    gen = %Slot{state: :generating, prompt: {1, 2, 3}, n_prompt: 3, fed: [5, 4], pos: 5}

    assert Placement.donor_prefix_match(gen, [1, 2, 3, 4, 5, 6]) == 5
    assert Placement.donor_prefix_match(gen, [1, 2, 9]) == 2
    assert Placement.prefix_usable?(808, 799, 512)
    refute Placement.prefix_usable?(808, 299, 512)
    assert Placement.prefix_usable?(100_000, 5, 0)

    pre = %Slot{state: :prefilling, prompt: {1, 2, 3, 4}, prefill_pos: 2}
    assert Placement.donor_prefix_match(pre, [1, 2, 3, 4]) == 2
  end
end
