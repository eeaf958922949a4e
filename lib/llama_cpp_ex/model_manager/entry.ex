defmodule LlamaCppEx.ModelManager.Entry do
  @moduledoc """
  One model known to `LlamaCppEx.ModelManager`. `n_gpu_layers` is the number of layers
  that run on a GPU once loaded: all of the model's (a CUDA build that placed it on a GPU,
  see `LlamaCppEx.Model`'s "Placement") or 0. The memory budget counts every model against
  host memory; GPU memory is not budgeted yet.
  """

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
    n_gpu_layers: 0
  ]

  @type status :: :loading | :ready | :unloading | :error
  @type t :: %__MODULE__{
          id: term(),
          mode: :server | :direct | nil,
          model: LlamaCppEx.Model.t() | nil,
          server_pid: pid() | nil,
          monitor_ref: reference() | nil,
          source: {:path, Path.t()} | {:hub, String.t(), String.t()} | nil,
          error: term(),
          loaded_at: integer() | nil,
          last_used: integer() | nil,
          status: status(),
          capabilities: [atom()],
          byte_size: non_neg_integer(),
          est_bytes: non_neg_integer(),
          n_gpu_layers: integer()
        }

  @doc "The entry without its process and resource references."
  @spec to_public(t()) :: map()
  def to_public(%__MODULE__{} = e),
    do: e |> Map.from_struct() |> Map.drop([:model, :server_pid, :monitor_ref])
end
