defmodule LlamaCppEx.Server.BatchStrategy do
  @moduledoc """
  How a `LlamaCppEx.Server` fills the token budget of one forward pass.

  Each tick the server calls `c:build_batch/4` with its slots (`%{seq_id =>
  %LlamaCppEx.Server.Slot{}}`), the budget (`:n_batch`), the per-slot prefill cap
  (`:chunk_size`) and `[queue_depth: n, tick: t]`. The strategy returns a plan, in forward
  order: `{:decode, seq_id}` for a generating slot's next token, `{:prefill, seq_id, n}` for
  the next `n` prompt tokens of a prefilling slot. The server checks the plan (a malformed one
  raises an `ArgumentError` naming the strategy and what it returned), then builds the batch:
  strategies decide, they never edit slots.

  Slot fields a strategy may read: `state` (`:idle | :prefilling | :generating`), `pos`,
  `n_prompt`, `prefill_pos`, `pending` (a generating slot is ready to decode when it is set)
  and `request.t_start`. `LlamaCppEx.Server.Strategy.Batch` has the helpers the built-in
  strategies share.

  Built-in strategies:

  | Strategy | Order | Use when |
  |---|---|---|
  | `DecodeMaximal` (default) | decode first, then prefill with what is left | interactive latency: running streams never stall |
  | `PrefillPriority` | prefill first, then decode | batch jobs: new requests start as fast as possible |
  | `Balanced` | decode capped at half the budget, then prefill | mixed traffic |
  | `Fair` | round-robin decode starting after last tick's first slot, then prefill | many streams and a budget smaller than the slot count |
  | `LatencyFirst` | prefill of the youngest requests first, then decode | time-to-first-token matters most |
  | `ThroughputFirst` | longest sequences first, everything eligible | maximum tokens per forward pass |

  A custom strategy is any module exporting `build_batch/4`, e.g. one that switches to
  `PrefillPriority` when `opts[:queue_depth] > 4`.
  """

  @type plan_item ::
          {:decode, non_neg_integer()} | {:prefill, non_neg_integer(), pos_integer()}

  @callback build_batch(
              slots :: %{non_neg_integer() => LlamaCppEx.Server.Slot.t()},
              budget :: pos_integer(),
              chunk_size :: pos_integer(),
              opts :: keyword()
            ) :: [plan_item()]
end
