defmodule LlamaCppEx.Server.State do
  @moduledoc false
  # A server's state between messages.

  defstruct [
    :config,
    :model,
    :ctx,
    :engine,
    :stats,
    swa_window: 0,
    slots: %{},
    queue: :queue.new(),
    sessions: %{},
    # the step being computed: %{ref, decode, prefill}
    in_flight: nil,
    tick_scheduled: false,
    tick: 0,
    # KV operations decided since the last step, shipped with the next one
    pending_ops: [],
    audits: [],
    # Server.embed/3 calls: jobs by reply ref, their order, and the free embedding sequence ids
    embed_jobs: %{},
    embed_order: [],
    embed_free: [],
    # tokens the KV cache's free blocks hold, as of the last step (admission estimate)
    kv_free: 0,
    # the KV precision policy's live state (LlamaCppEx.Server.KvPolicy), nil without one
    kv_policy: nil,
    # the level-2 prompt cache (LlamaCppEx.Server.PromptCache)
    prompt_cache: nil,
    # pause levels (LlamaCppEx.Server.PausePolicy): set by pause/2, and in effect
    pause_manual: :none,
    pause_level: :none,
    policy_warned: false,
    warned_instability: false
  ]

  @type t :: %__MODULE__{}
end
