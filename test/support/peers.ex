defmodule LlamaCppEx.Peers do
  @moduledoc false
  # Extra BEAM nodes on the loopback interface (OTP's `:peer`), running this node's code with
  # the library started, for the cluster tests and bench/cluster.exs.

  @doc "Makes this node distributed (starting epmd when needed)."
  def ensure_distributed! do
    unless Node.alive?() do
      {_, 0} = System.cmd("epmd", ["-daemon"])
      name = :"llama_test_#{System.unique_integer([:positive])}@127.0.0.1"
      {:ok, _} = Node.start(name, :longnames)
    end

    :ok
  end

  @doc "Starts a peer node linked to the caller: `{peer, node}`."
  def start!(prefix) do
    ensure_distributed!()

    {:ok, peer, node} =
      :peer.start_link(%{
        name: :"#{prefix}_#{System.unique_integer([:positive])}",
        host: ~c"127.0.0.1",
        longnames: true,
        # two cores on the test machines: schedulers must not spin waiting for work
        # (and a node halted on purpose is not a partition for `global` to warn about)
        args:
          Enum.map(
            ~w(+sbwt none +sbwtdcpu none +sbwtdio none
               -kernel prevent_overlapping_partitions false -setcookie),
            &to_charlist/1
          ) ++ [Atom.to_charlist(Node.get_cookie())]
      })

    :ok = :erpc.call(node, :code, :add_paths, [:code.get_path()])

    for {k, v} <- Application.get_all_env(:llama_cpp_ex),
        do: :ok = :erpc.call(node, Application, :put_env, [:llama_cpp_ex, k, v])

    {:ok, _} = :erpc.call(node, Application, :ensure_all_started, [:llama_cpp_ex])
    {peer, node}
  end

  @doc "Starts a `LlamaCppEx.Server` with `opts` on `node`, under the library's supervisor there."
  def start_server!(node, opts) do
    spec = Supervisor.child_spec({LlamaCppEx.Server, opts}, id: make_ref())
    {:ok, pid} = :erpc.call(node, Supervisor, :start_child, [LlamaCppEx.Supervisor, spec])
    wait_model(pid)
  end

  defp wait_model(pid) do
    case LlamaCppEx.Server.fetch_model(pid) do
      {:ok, _} -> pid
      {:error, :not_ready} -> wait_model(pid)
    end
  end
end
