defmodule LlamaCppEx.ModelManager.Backend do
  @moduledoc """
  What `LlamaCppEx.ModelManager` needs from the outside world: resolving a source to a file,
  loading a model, starting and stopping a model's server. `LlamaCppEx.ModelManager.ModelIO`
  is the real one; tests pass their own with the manager's `:io` option.
  """

  @callback resolve_source(source :: term(), opts :: keyword()) ::
              {:ok, Path.t(), non_neg_integer()} | {:error, term()}
  @callback load_model(path :: Path.t(), opts :: keyword()) ::
              {:ok, LlamaCppEx.Model.t()} | {:error, term()}
  @callback start_server(id :: term(), path :: Path.t(), opts :: keyword()) ::
              {:ok, pid()} | {:error, term()}
  @callback stop_server(pid()) :: :ok

  @doc """
  The options `LlamaCppEx.ModelManager.load/3` accepts with this backend; any other raises
  `ArgumentError` in the caller. A backend without it receives every option as given.
  """
  @callback option_keys() :: [atom()]

  @optional_callbacks option_keys: 0
end
