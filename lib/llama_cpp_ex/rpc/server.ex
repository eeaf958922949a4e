defmodule LlamaCppEx.RPC.Server do
  @moduledoc """
  `llama_cpp_ex`'s ggml-rpc server process, which serves this node's devices to other nodes'
  models. This engine has no ggml-rpc, so it never starts: `start_link/1` returns
  `{:error, {:rpc, :rpc_unsupported}}` (after checking its options, as `llama_cpp_ex` does),
  and a supervisor that lists it fails to start it with that reason.
  """

  use GenServer, restart: :temporary

  @keys [:endpoint, :cache_dir, :n_threads, :devices, :name]

  @doc """
  Options: `:endpoint` (required, `"host:port"`), `:cache_dir`, `:n_threads` (4),
  `:devices` (`[]`), `:name`. Returns `{:error, {:rpc, :rpc_unsupported}}`.
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    LlamaCppEx.Options.validate!(opts, @keys, "LlamaCppEx.RPC.Server.start_link/1")

    unless is_binary(opts[:endpoint]),
      do:
        raise(ArgumentError, "LlamaCppEx.RPC.Server.start_link/1 needs :endpoint (\"host:port\")")

    # nothing to serve: no process is started (so no exit signal reaches the caller)
    {:error, {:rpc, :rpc_unsupported}}
  end

  @doc "`%{endpoint, devices}` of a running server (none runs on this engine)."
  @spec info(GenServer.server()) :: %{endpoint: String.t(), devices: [map()]}
  def info(server), do: GenServer.call(server, :info)

  @impl true
  def init(_opts), do: {:stop, {:rpc, :rpc_unsupported}}
end
