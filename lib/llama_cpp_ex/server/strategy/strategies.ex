defmodule LlamaCppEx.Server.Strategy.DecodeMaximal do
  @moduledoc "Decode tokens first, then prefill with the remaining budget (the default)."
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, _opts) do
    {e, n, s, b} = Batch.add_decode_tokens(slots, [], 0, budget)
    Batch.finish(Batch.add_prefill_chunks(s, e, n, b, chunk_size))
  end
end

defmodule LlamaCppEx.Server.Strategy.PrefillPriority do
  @moduledoc "Prefill first, then decode with the remaining budget."
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, _opts) do
    {e, n, s, b} = Batch.add_prefill_chunks(slots, [], 0, budget, chunk_size)
    Batch.finish(Batch.add_decode_tokens(s, e, n, b))
  end
end

defmodule LlamaCppEx.Server.Strategy.Balanced do
  @moduledoc """
  Decode capped at `min(div(budget, 2), generating slots)`, then prefill with the rest plus
  whatever the decode cap left unused.
  """
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, _opts) do
    n_generating = Enum.count(slots, fn {_, s} -> s.state == :generating end)
    decode_budget = min(div(budget, 2), n_generating)
    {e, n, s, left} = Batch.add_decode_tokens(slots, [], 0, decode_budget)
    prefill_budget = budget - decode_budget + left
    {e, n, s, _} = Batch.add_prefill_chunks(s, e, n, prefill_budget, chunk_size)
    Batch.finish({e, n, s, 0})
  end
end

defmodule LlamaCppEx.Server.Strategy.Fair do
  @moduledoc """
  Round-robin decode: when the budget cannot hold every generating slot, the slot after the
  one that went first last tick goes first now. Then prefill.
  """
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, opts) do
    ids = slots |> Map.keys() |> Enum.sort()
    start = rem(Keyword.get(opts, :tick, 0), max(length(ids), 1))
    {a, b} = Enum.split(ids, start)
    {e, n, s, left} = Batch.add_decode_tokens(slots, [], 0, budget, b ++ a)
    Batch.finish(Batch.add_prefill_chunks(s, e, n, left, chunk_size))
  end
end

defmodule LlamaCppEx.Server.Strategy.LatencyFirst do
  @moduledoc """
  Prefill first, youngest requests (latest `t_start`) first, so new requests reach their
  first token soonest; then decode.
  """
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, _opts) do
    order = Batch.order(slots, :prefilling, &(-(&1.t_start || 0)))
    {e, n, s, b} = Batch.add_prefill_chunks(slots, [], 0, budget, chunk_size, order)
    Batch.finish(Batch.add_decode_tokens(s, e, n, b))
  end
end

defmodule LlamaCppEx.Server.Strategy.ThroughputFirst do
  @moduledoc """
  Longest sequences first (decode slots by position, prefill slots by prompt length), with
  every eligible token batched; maximises tokens per forward pass.
  """
  @behaviour LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def build_batch(slots, budget, chunk_size, _opts) do
    decode_order = Batch.order(slots, :generating, &(-&1.pos))
    prefill_order = Batch.order(slots, :prefilling, &(-&1.n_prompt_tokens))
    {e, n, s, b} = Batch.add_decode_tokens(slots, [], 0, budget, decode_order)
    Batch.finish(Batch.add_prefill_chunks(s, e, n, b, chunk_size, prefill_order))
  end
end
