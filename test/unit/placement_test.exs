defmodule LlamaCppEx.Server.PlacementTest do
  use ExUnit.Case, async: true

  import LlamaCppEx.ServerFixtures, only: [request: 1, request: 2]
  alias LlamaCppEx.Server.{Config, Placement, PromptCache, Slot, State, Stats}

  defp idle(seq, cached, t \\ 0, scope \\ nil),
    do: %Slot{seq: seq, cached: cached, t_last_used: t, cache_scope: scope}

  defp generating(seq, scope) do
    %Slot{
      seq: seq,
      state: :generating,
      prompt: {1, 2, 3, 4},
      n_prompt: 4,
      pos: 4,
      pending: 7,
      cache_scope: scope,
      request: request([1, 2, 3, 4])
    }
  end

  defp state(slots, queue, opts \\ []) do
    %State{
      config: %Config{kv_unified: Keyword.get(opts, :kv_unified, true)},
      stats: Stats.new(),
      prompt_cache: Keyword.get(opts, :prompt_cache, PromptCache.new(0)),
      slots: Map.new(slots, &{&1.seq, &1}),
      queue: :queue.from_list(queue),
      sessions: Keyword.get(opts, :sessions, %{}),
      kv_free: Keyword.get(opts, :kv_free, 10_000),
      kv_exclusive: Keyword.get(opts, :kv_exclusive, %{})
    }
  end

  test "a request takes the idle slot caching its longest prefix, and trims what differs" do
    st =
      state([idle(0, [9, 9, 9]), idle(1, [1, 2, 3, 4, 5, 6, 7])], [request([1, 2, 3, 4, 8, 9])])

    st = Placement.dequeue(st)
    assert %Slot{state: :prefilling, prefill_pos: 4, n_prompt: 6} = st.slots[1]
    assert st.pending_ops == [{:trim, 1, 4}]
    assert :queue.is_empty(st.queue)
  end

  test "the whole prompt cached still leaves one token to evaluate" do
    st = state([idle(0, [1, 2, 3])], [request([1, 2, 3])]) |> Placement.dequeue()
    assert %Slot{prefill_pos: 2} = st.slots[0]
    assert st.pending_ops == [{:trim, 0, 2}]
  end

  test "without a useful cache the least recently used slot is taken" do
    st = state([idle(0, [], 5), idle(1, [], 2), idle(2, [], 9)], [request([7, 7])])
    assert %Slot{state: :prefilling} = Placement.dequeue(st).slots[1]
  end

  test "a session goes back to its slot while that slot is idle" do
    st =
      state([idle(0, [1, 2, 3, 4]), idle(1, [])], [request([1, 2, 3, 4, 5], session: "s")],
        sessions: %{{nil, "s"} => 1}
      )

    st = Placement.dequeue(st)
    assert %Slot{state: :prefilling, session: "s"} = st.slots[1]
    # its prefix comes from the other slot's blocks, shared, not evaluated
    assert st.pending_ops == [{:share, 0, 1, 4}]
    assert st.slots[1].prefill_pos == 4
  end

  test "another slot's prefix is shared only within a cache scope and with kv_unified" do
    r = fn -> request([1, 2, 3, 4, 5], cache_scope: "b") end
    shared? = fn st -> Enum.any?(st.pending_ops, &match?({:share, _, _, _}, &1)) end
    placed = fn st -> Enum.find_value(st.slots, fn {_, s} -> s.state == :prefilling && s end) end

    st = state([idle(0, [1, 2, 3, 4], 0, "a"), idle(1, [], 1)], [r.()]) |> Placement.dequeue()
    refute shared?.(st)
    assert placed.(st).prefill_pos == 0

    st =
      state([generating(0, "b"), idle(1, [], 1)], [r.()], kv_unified: false)
      |> Placement.dequeue()

    refute shared?.(st)
    assert placed.(st).prefill_pos == 0
  end

  test "cache_prompt: false reuses nothing" do
    st = state([idle(0, [1, 2, 3, 4])], [request([1, 2, 3, 4, 5], cache_prompt: false)])
    st = Placement.dequeue(st)
    assert st.slots[0].prefill_pos == 0
  end

  test "a slot's cache about to be overwritten is copied to the RAM cache first" do
    old = Enum.to_list(100..160)
    st = state([idle(0, old)], [request([1, 2, 3])], prompt_cache: PromptCache.new(1))
    st = Placement.dequeue(st)
    assert [{:save, 0, 61, _max, _tag}, {:trim, 0, 0}] = st.pending_ops
  end

  test "the RAM cache's entry is restored when it holds the longest prefix" do
    toks = Enum.to_list(1..64)

    {:ok, cache, _entry, []} = PromptCache.load(PromptCache.new(1), toks, nil, make_ref(), 100)

    st = state([idle(0, [])], [request(toks ++ [99])], prompt_cache: cache)
    st = Placement.dequeue(st)
    assert [{:restore, 0, _ref, 64}] = st.pending_ops
    assert st.slots[0].prefill_pos == 64
    assert PromptCache.stats(st.prompt_cache).ram_cache_hits == 1
  end

  test "a request waits while the engine's count of free and idle blocks cannot take it" do
    active = %Slot{seq: 1, state: :generating, pending: 5, pos: 10, n_prompt: 10}
    # an idle slot whose blocks others share frees nothing: only its exclusive tokens count
    base = [idle(0, Enum.to_list(1..200)), active]
    queue = [request(Enum.to_list(1..150))]

    st = state(base, queue, kv_free: 100, kv_exclusive: %{0 => 20})
    assert :queue.len(Placement.dequeue(st).queue) == 1

    st = state(base, queue, kv_free: 100, kv_exclusive: %{0 => 60})
    assert :queue.is_empty(Placement.dequeue(st).queue)

    # with nothing active, nothing would free blocks: the request goes anyway
    st = state([idle(0, [])], queue, kv_free: 0)
    assert :queue.is_empty(Placement.dequeue(st).queue)
  end

  test "prefix matching" do
    assert Placement.common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    idle = [{0, idle(0, [1, 2, 3, 4], 5)}, {1, idle(1, [1, 9], 1)}]
    assert Placement.pick_cached_slot(idle, [1, 2, 3, 4, 5, 6]) == {0, 4}
    # a prefix of 10% or less of the prompt does not count
    assert Placement.pick_cached_slot(idle, [1 | Enum.to_list(100..108)]) == {1, 0}
    assert Placement.pick_lru_slot(idle) == 1

    gen = %Slot{state: :generating, prompt: {1, 2, 3}, n_prompt: 3, fed: [5, 4]}
    assert Placement.donor_prefix_match(gen, [1, 2, 3, 4, 5, 6]) == 5
    pre = %Slot{state: :prefilling, prompt: {1, 2, 3, 4}, n_prompt: 4, prefill_pos: 2}
    assert Placement.donor_prefix_match(pre, [1, 2, 3, 4]) == 2
  end
end
