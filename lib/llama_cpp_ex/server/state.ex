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
    warned_instability: false
  ]

  @type t :: %__MODULE__{}
end
