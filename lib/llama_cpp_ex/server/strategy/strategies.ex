defmodule LlamaCppEx.Server.Strategy.DecodeMaximal do
  @moduledoc "Decode tokens first, then prefill with the remaining budget (the default)."
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, _opts) do
    Batch.start(budget)
    |> Batch.decode(slots)
    |> Batch.prefill(slots, chunk_size)
    |> Batch.finish()
  end
end

defmodule LlamaCppEx.Server.Strategy.PrefillPriority do
  @moduledoc "Prefill first, then decode with the remaining budget."
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, _opts) do
    Batch.start(budget)
    |> Batch.prefill(slots, chunk_size)
    |> Batch.decode(slots)
    |> Batch.finish()
  end
end

defmodule LlamaCppEx.Server.Strategy.Balanced do
  @moduledoc """
  Decode capped at `min(div(budget, 2), generating slots)`, then prefill with the rest plus
  whatever the decode cap left unused.
  """
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, _opts) do
    n_generating = Enum.count(slots, fn {_, s} -> s.state == :generating end)
    decode_budget = min(div(budget, 2), n_generating)
    {plan, left} = Batch.decode(Batch.start(decode_budget), slots)

    {plan, budget - decode_budget + left}
    |> Batch.prefill(slots, chunk_size)
    |> Batch.finish()
  end
end

defmodule LlamaCppEx.Server.Strategy.Fair do
  @moduledoc """
  Round-robin decode: when the budget cannot hold every generating slot, the slot after the
  one that went first last tick goes first now. Then prefill.
  """
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, opts) do
    ids = slots |> Map.keys() |> Enum.sort()
    start = rem(Keyword.get(opts, :tick, 0), max(length(ids), 1))
    {a, b} = Enum.split(ids, start)

    Batch.start(budget)
    |> Batch.decode(slots, b ++ a)
    |> Batch.prefill(slots, chunk_size)
    |> Batch.finish()
  end
end

defmodule LlamaCppEx.Server.Strategy.LatencyFirst do
  @moduledoc """
  Prefill first, youngest requests (latest start) first, so new requests reach their first
  token soonest; then decode.
  """
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, _opts) do
    order = Batch.order(slots, :prefilling, &(-(&1.request.t_start || 0)))

    Batch.start(budget)
    |> Batch.prefill(slots, chunk_size, order)
    |> Batch.decode(slots)
    |> Batch.finish()
  end
end

defmodule LlamaCppEx.Server.Strategy.ThroughputFirst do
  @moduledoc """
  Longest sequences first (decode slots by position, prefill slots by prompt length), with
  every eligible token batched; maximises tokens per forward pass.
  """
  use LlamaCppEx.Server.BatchStrategy
  alias LlamaCppEx.Server.Strategy.Batch

  @impl true
  def plan(slots, budget, chunk_size, _opts) do
    decode_order = Batch.order(slots, :generating, &(-&1.pos))
    prefill_order = Batch.order(slots, :prefilling, &(-&1.n_prompt))

    Batch.start(budget)
    |> Batch.decode(slots, decode_order)
    |> Batch.prefill(slots, chunk_size, prefill_order)
    |> Batch.finish()
  end
end
