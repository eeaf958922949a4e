defmodule LlamaCppEx.Server.BatchStrategy do
  @moduledoc """
  How a `LlamaCppEx.Server` fills the token budget of one forward pass. A strategy comes in
  one of two shapes; the server runs either.

  ## `llama_cpp_ex`'s shape: `c:build_batch/4`

  A strategy written for `llama_cpp_ex` runs unchanged. Each tick the server calls
  `build_batch(slots, budget, chunk_size, opts)` with slot maps (`%{seq_id => slot}`, the
  contract's 29 fields: `state`, `pending_token`, `pos`, `prefill_pos`, `n_prompt_tokens`,
  `prompt_tokens`, `prompt_tokens_tuple`, `generated_token_ids`, `batch_idx`, `t_start`, …),
  the budget (`:n_batch`), the per-slot prefill cap (`:chunk_size`) and
  `[model_ref: ref, queue_depth: n, tick: t]`. It returns `{entries, updated_slots}`, the
  entries `{token, pos, seq_id, logits?}` in forward order: a generating slot's
  `{pending_token, pos, seq_id, true}`, a prefilling slot's next prompt tokens from
  `prefill_pos` on, with logits only on the token that completes the prompt.
  `LlamaCppEx.Server.Strategy.Batch.add_decode_tokens/4` and `add_prefill_chunks/5` build
  them as the contract's helpers do.

  The server reads the entries, not the updated slots (it keeps its own), and checks them:
  each sequence's entries must be exactly what its slot feeds next. The consumer fields of
  the maps (`from`, `stream_pid`, `stream_ref`, `monitor_ref`) are `nil`; a strategy never
  messages consumers.

  ## This library's shape: `c:plan/4`

  A module that exports `plan/4` is called with the slots as `%LlamaCppEx.Server.Slot{}`
  structs and returns a plan, in forward order: `{:decode, seq_id}` for a generating slot's
  next token, `{:prefill, seq_id, n}` for the next `n` prompt tokens of a prefilling slot.
  Strategies decide, they never edit slots. Fields a plan may read: `state`, `pos`,
  `n_prompt`, `prefill_pos`, `pending` and `request.t_start`. `use
  LlamaCppEx.Server.BatchStrategy` defines `build_batch/4` from `plan/4`, so the module
  answers contract callers too. The built-in strategies are plan-shaped:

  | Strategy | Order | Use when |
  |---|---|---|
  | `DecodeMaximal` (default) | decode first, then prefill with what is left | interactive latency: running streams never stall |
  | `PrefillPriority` | prefill first, then decode | batch jobs: new requests start as fast as possible |
  | `Balanced` | decode capped at half the budget, then prefill | mixed traffic |
  | `Fair` | round-robin decode starting after last tick's first slot, then prefill | many streams and a budget smaller than the slot count |
  | `LatencyFirst` | prefill of the youngest requests first, then decode | time-to-first-token matters most |
  | `ThroughputFirst` | longest sequences first, everything eligible | maximum tokens per forward pass |

  ## When a strategy fails

  A strategy that raises, or answers something that is not a valid batch (the error names
  the strategy and what it returned), does not take the server down: that tick is planned by
  `DecodeMaximal`, the error is logged once per server, and every failing tick emits
  `[:llama_cpp_ex, :server, :strategy, :exception]` with `%{count: 1}` and
  `%{server: pid, strategy: module, kind: kind, reason: reason}`.
  """

  @type plan_item ::
          {:decode, non_neg_integer()} | {:prefill, non_neg_integer(), pos_integer()}
  @type entry :: {non_neg_integer(), non_neg_integer(), non_neg_integer(), boolean()}

  @doc "The contract's callback: slot maps in, `{entries, updated_slots}` out."
  @callback build_batch(
              slots :: %{non_neg_integer() => map()},
              budget :: pos_integer(),
              chunk_size :: pos_integer(),
              opts :: keyword()
            ) :: {[entry()], %{non_neg_integer() => map()}}

  @doc "This library's callback: `%Slot{}` structs in, a plan out."
  @callback plan(
              slots :: %{non_neg_integer() => LlamaCppEx.Server.Slot.t()},
              budget :: pos_integer(),
              chunk_size :: pos_integer(),
              opts :: keyword()
            ) :: [plan_item()]

  @optional_callbacks plan: 4

  @doc false
  defmacro __using__(_opts) do
    quote do
      @behaviour LlamaCppEx.Server.BatchStrategy

      @impl true
      def build_batch(slots, budget, chunk_size, opts),
        do:
          LlamaCppEx.Server.Strategy.Contract.build_batch(
            &plan/4,
            slots,
            budget,
            chunk_size,
            opts
          )
    end
  end
end
