defmodule LlamaCppEx.Server.State do
  @moduledoc false
  # A server's state between messages.

  alias LlamaCppEx.{Context, Model}
  alias LlamaCppEx.Engine.Step
  alias LlamaCppEx.Server.{Config, EmbedJob, KvPolicy, PromptCache, Request, Slot, Stats}

  @enforce_keys [:config, :stats, :prompt_cache]
  defstruct [
    :config,
    :stats,
    :prompt_cache,
    model: nil,
    ctx: nil,
    engine: nil,
    swa_window: 0,
    slots: %{},
    queue: :queue.new(),
    sessions: %{},
    in_flight: nil,
    chained: nil,
    tick_scheduled: false,
    tick: 0,
    pending_ops: [],
    audits: [],
    pause_waiters: [],
    embed_jobs: %{},
    embed_order: [],
    embed_free: [],
    kv_free: 0,
    kv_exclusive: %{},
    kv_policy: nil,
    pause_manual: :none,
    pause_level: :none,
    policy_warned: false,
    warned_instability: false,
    strategy_warned: false,
    cluster: %LlamaCppEx.Cluster.Member{}
  ]

  @typedoc """
  A step queued or being computed: its reply ref, whether it was queued behind the step
  before it (`:overlap`, unplanned), row counts, the sequences of its decode rows when they
  are all it has (else `[]`: no step may be queued behind it), save tags and embedding
  texts.
  """
  @type flight :: %{
          ref: reference(),
          queued: boolean(),
          decode: non_neg_integer(),
          prefill: non_neg_integer(),
          rows: [non_neg_integer()],
          save_tags: [pos_integer()],
          embed: non_neg_integer(),
          embeds: %{non_neg_integer() => {reference(), non_neg_integer()}}
        }

  @type t :: %__MODULE__{
          config: Config.t(),
          stats: Stats.t(),
          # the level-2 prompt cache
          prompt_cache: PromptCache.t(),
          # nil until the model has loaded
          model: Model.t() | nil,
          ctx: Context.t() | nil,
          engine: reference() | nil,
          # the smallest sliding window of the model's layers (0: none)
          swa_window: non_neg_integer(),
          slots: %{non_neg_integer() => Slot.t()},
          queue: :queue.queue(Request.t()),
          # `{cache_scope, session}` => the slot it last used
          sessions: %{term() => non_neg_integer()},
          in_flight: flight() | nil,
          # a decode step queued behind `in_flight` before its outcome came (`:overlap`)
          chained: flight() | nil,
          tick_scheduled: boolean(),
          tick: non_neg_integer(),
          # KV operations decided since the last step, shipped with the next one
          pending_ops: [Step.kv_op()],
          # kv_audit/1 callers waiting for the engine to go idle
          audits: [GenServer.from()],
          # pause/2 callers waiting for the step in flight to finish
          pause_waiters: [GenServer.from()],
          # Server.embed/3 calls by reply ref, their order, the free embedding sequence ids
          embed_jobs: %{reference() => EmbedJob.t()},
          embed_order: [reference()],
          embed_free: [non_neg_integer()],
          # the engine's KV counts after the last step (admission): tokens its free blocks
          # hold, and per sequence the tokens of the blocks it alone holds
          kv_free: non_neg_integer(),
          kv_exclusive: %{non_neg_integer() => non_neg_integer()},
          # the KV precision policy's live state, nil without one
          kv_policy: KvPolicy.t() | nil,
          # pause levels: set by pause/2, and in effect
          pause_manual: :none | :prefill | :full,
          pause_level: :none | :prefill | :full,
          policy_warned: boolean(),
          warned_instability: boolean(),
          strategy_warned: boolean(),
          # the cluster groups it is in and its last published load
          cluster: LlamaCppEx.Cluster.Member.t()
        }
end
