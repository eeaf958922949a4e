defmodule LlamaCppEx.Server.Strategy.Contract do
  @moduledoc false
  # The bridge between the two shapes of a batch strategy (see
  # `LlamaCppEx.Server.BatchStrategy`): a contract-shaped module (`llama_cpp_ex`'s
  # `build_batch/4` over slot maps, answering `{entries, slots}`) runs on this server through
  # `plan/6`, which hands it slot maps and turns its entries back into a plan; a plan-shaped
  # module answers contract callers through `build_batch/5`, which runs its plan over slot
  # maps as the contract's helpers would have.

  alias LlamaCppEx.Server.Slot

  @doc """
  The contract's slot map of `slot`: the 29 fields of `llama_cpp_ex`'s slots. The consumer
  fields (`from`, `stream_pid`, `stream_ref`, `monitor_ref`) are `nil`: results reach
  consumers after the pass, never from a strategy; `accumulated_pieces` and `utf8_pending`
  are empty (the text is assembled elsewhere).
  """
  @spec slot_map(Slot.t()) :: map()
  def slot_map(%Slot{} = s) do
    r = s.request
    prompt = Tuple.to_list(s.prompt)

    %{
      state: s.state,
      from: nil,
      stream_pid: nil,
      stream_ref: nil,
      monitor_ref: nil,
      reply_mode: if(r && r.mode != :stream, do: :full, else: nil),
      cache_prompt: if(r, do: r.cache_prompt, else: true),
      prompt_tokens: prompt,
      prompt_tokens_tuple: s.prompt,
      prefill_pos: s.prefill_pos,
      pos: s.pos,
      pending_token: s.pending,
      pending_eog: false,
      batch_idx: -1,
      tokens_generated: length(s.fed) + if(s.pending, do: 1, else: 0),
      max_tokens: if(r, do: r.max_tokens, else: 0),
      accumulated_pieces: [],
      utf8_pending: "",
      t_start: r && r.t_start,
      t_first_token: r && r.t_first_token,
      n_prompt_tokens: s.n_prompt,
      cached_tokens: s.cached,
      cached_pos: length(s.cached),
      cache_scope: s.cache_scope,
      generated_token_ids: s.fed,
      n_prefix_cache_tokens: if(r, do: r.n_prefix_cache, else: 0),
      sampler: r && r.sampler,
      t_last_used: s.t_last_used,
      session: s.session
    }
  end

  @doc """
  The plan of a contract-shaped `strategy`: its `build_batch/4` called with the slot maps of
  `slots`, its entries (`{token, pos, seq, logits?}`, which must be what the slots feed next)
  grouped by sequence in the order they first appear. A wrong answer raises `ArgumentError`
  naming the strategy and what it returned.
  """
  @spec plan(module(), map(), pos_integer(), pos_integer(), keyword(), reference()) :: list()
  def plan(strategy, slots, budget, chunk_size, opts, model_ref) do
    maps = Map.new(slots, fn {seq, s} -> {seq, slot_map(s)} end)

    case strategy.build_batch(maps, budget, chunk_size, [{:model_ref, model_ref} | opts]) do
      {entries, _slots} when is_list(entries) -> to_plan(entries, slots, strategy)
      other -> invalid!(strategy, other, "expected {entries, slots}")
    end
  end

  defp to_plan(entries, slots, strategy) do
    {order, runs} =
      Enum.reduce(entries, {[], %{}}, fn
        {_token, _pos, seq, _logits} = e, {order, runs} ->
          case runs do
            %{^seq => run} -> {order, %{runs | seq => [e | run]}}
            _ -> {[seq | order], Map.put(runs, seq, [e])}
          end

        other, _ ->
          invalid!(
            strategy,
            entries,
            "an entry is not {token, pos, seq_id, logits?}: " <>
              inspect(other)
          )
      end)

    order
    |> Enum.reverse()
    |> Enum.map(fn seq -> item(Map.get(slots, seq), seq, Enum.reverse(runs[seq]), strategy) end)
  end

  # the plan item whose entries these are, if they are exactly what the slot feeds next
  defp item(%Slot{state: :generating, pending: t, pos: pos}, seq, [{t, pos, seq, true}], _)
       when t != nil,
       do: {:decode, seq}

  defp item(%Slot{state: :prefilling} = s, seq, run, strategy) do
    n = length(run)
    completes = s.prefill_pos + n == s.n_prompt

    expected =
      if s.prefill_pos + n <= s.n_prompt do
        for i <- 0..(n - 1) do
          p = s.prefill_pos + i
          {elem(s.prompt, p), p, seq, completes and i == n - 1}
        end
      end

    if run == expected,
      do: {:prefill, seq, n},
      else: invalid!(strategy, run, "not slot #{seq}'s next prompt tokens")
  end

  defp item(nil, seq, run, strategy), do: invalid!(strategy, run, "no slot #{inspect(seq)}")

  defp item(_slot, seq, run, strategy),
    do: invalid!(strategy, run, "not what slot #{seq} feeds next")

  defp invalid!(strategy, value, why) do
    raise ArgumentError,
          "#{inspect(strategy)}.build_batch/4 returned an invalid batch (#{why}): " <>
            inspect(value, limit: 20)
  end

  @doc """
  The contract's answer of a plan-shaped strategy (`plan_fun`, its `plan/4`) for slot maps:
  `{entries, updated_slots}` with `batch_idx`, `prefill_pos` and `generated_token_ids`
  updated as the contract's `Server.Strategy.Batch` helpers update them.
  """
  @spec build_batch(function(), map(), integer(), pos_integer(), keyword()) :: {list(), map()}
  def build_batch(plan_fun, maps, budget, chunk_size, opts) do
    slots = Map.new(maps, fn {seq, m} -> {seq, from_map(seq, m)} end)

    {entries, _n, maps} =
      slots
      |> plan_fun.(budget, chunk_size, opts)
      |> Enum.reduce({[], 0, maps}, fn
        {:decode, seq}, {es, n, maps} -> feed_decode(maps, seq, es, n)
        {:prefill, seq, k}, {es, n, maps} -> feed_prefill(maps, seq, k, es, n)
      end)

    {Enum.reverse(entries), maps}
  end

  # the fields plan-shaped strategies read, from a slot map
  defp from_map(seq, m) do
    %Slot{
      seq: seq,
      state: m.state,
      pos: m.pos,
      pending: m.pending_token,
      n_prompt: m.n_prompt_tokens,
      prefill_pos: m.prefill_pos,
      prompt: m.prompt_tokens_tuple,
      request: %{t_start: m.t_start}
    }
  end

  @doc false
  # `{pending_token, pos, seq, true}` prepended (batch index `n`); the slot's batch_idx and
  # generated ids updated: `{entries, n, maps}`
  def feed_decode(maps, seq, entries, n) do
    m = maps[seq]
    m = %{m | batch_idx: n, generated_token_ids: [m.pending_token | m.generated_token_ids]}
    {[{m.pending_token, m.pos, seq, true} | entries], n + 1, Map.put(maps, seq, m)}
  end

  @doc false
  # `k` prompt entries prepended; logits and a batch_idx only when the chunk completes the
  # prompt: `{entries, n, maps}`
  def feed_prefill(maps, seq, k, entries, n) do
    m = maps[seq]
    completes = m.prefill_pos + k >= m.n_prompt_tokens

    entries =
      Enum.reduce(0..(k - 1)//1, entries, fn i, es ->
        p = m.prefill_pos + i
        [{elem(m.prompt_tokens_tuple, p), p, seq, completes and i == k - 1} | es]
      end)

    batch_idx = if completes, do: n + k - 1, else: -1
    m = %{m | batch_idx: batch_idx, prefill_pos: m.prefill_pos + k}
    {entries, n + k, Map.put(maps, seq, m)}
  end
end
