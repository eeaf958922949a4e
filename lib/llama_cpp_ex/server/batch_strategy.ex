defmodule LlamaCppEx.Server.BatchStrategy do
  @moduledoc """
  How a `LlamaCppEx.Server` fills the token budget of one forward pass.

  Each tick the server calls `c:build_batch/4` with its slots, the budget (`:n_batch`), the
  per-slot prefill cap (`:chunk_size`) and `[model_ref: ..., queue_depth: n]`. The strategy
  returns the batch entries `{token_id, pos, seq_id, logits?}` in forward order and the slots
  updated to reflect what was fed (use the helpers in `LlamaCppEx.Server.Strategy.Batch`).

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

  @type slot :: map()
  @type entry :: {non_neg_integer(), non_neg_integer(), non_neg_integer(), boolean()}

  @callback build_batch(
              slots :: %{non_neg_integer() => slot()},
              budget :: pos_integer(),
              chunk_size :: pos_integer(),
              opts :: keyword()
            ) :: {[entry()], %{non_neg_integer() => slot()}}
end
