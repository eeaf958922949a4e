defmodule LlamaCppEx.RPC do
  @moduledoc """
  `llama_cpp_ex`'s distributed offload through ggml-rpc, answered as a `llama_cpp_ex` built
  without RPC answers: this engine has no ggml-rpc backend, so no remote device is ever
  added and `LlamaCppEx.Model.load/2` refuses `:rpc_servers` other than `[]`.

      LlamaCppEx.RPC.supported?()
      #=> false
      LlamaCppEx.RPC.add_server("10.0.0.2:50052")
      #=> {:error, :rpc_unsupported}

  To spread work over machines, run a `LlamaCppEx.Server` per node and route requests to them
  (each node holds the whole model; see the README's roadmap for the cluster).
  """

  @doc "Whether this build can reach RPC devices: never."
  @spec supported?() :: false
  def supported?, do: false

  @doc "Registers an RPC endpoint: `{:error, :rpc_unsupported}`."
  @spec add_server(String.t()) :: {:ok, non_neg_integer()} | {:error, :rpc_unsupported}
  def add_server(endpoint) when is_binary(endpoint), do: {:error, :rpc_unsupported}

  @doc """
  Registers endpoints in order: `{:ok, 0}` for none, else the first one's error,
  `{:error, {endpoint, :rpc_unsupported}}`.
  """
  @spec add_servers([String.t()]) :: {:ok, non_neg_integer()} | {:error, {String.t(), atom()}}
  def add_servers([]), do: {:ok, 0}

  def add_servers([endpoint | _]) do
    {:error, reason} = add_server(endpoint)
    {:error, {endpoint, reason}}
  end

  @doc "The RPC devices among `LlamaCppEx.devices/0`: none."
  @spec devices() :: [map()]
  def devices, do: Enum.filter(LlamaCppEx.devices(), &(&1.backend == "RPC"))

  @doc "Checks that an RPC server answers at `endpoint`: `{:error, :rpc_unsupported}`."
  @spec ping(String.t()) :: :ok | {:error, term()}
  def ping(endpoint) when is_binary(endpoint), do: {:error, :rpc_unsupported}
end
