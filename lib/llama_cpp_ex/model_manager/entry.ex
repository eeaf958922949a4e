defmodule LlamaCppEx.ModelManager.Entry do
  @moduledoc "One model known to `LlamaCppEx.ModelManager`."

  defstruct [
    :id,
    :mode,
    :model,
    :server_pid,
    :monitor_ref,
    :source,
    :error,
    :loaded_at,
    :last_used,
    status: :loading,
    capabilities: [:generate, :chat],
    byte_size: 0,
    est_bytes: 0,
    n_gpu_layers: 99
  ]

  @type status :: :loading | :ready | :unloading | :error
  @type t :: %__MODULE__{}

  @doc "The entry without its process and resource references."
  @spec to_public(t()) :: map()
  def to_public(%__MODULE__{} = e),
    do: e |> Map.from_struct() |> Map.drop([:model, :server_pid, :monitor_ref])
end
