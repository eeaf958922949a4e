defmodule LlamaCppEx.Cluster.Directory do
  @moduledoc false
  # One per node, under the application: a table of the load every replica of every group
  # last published, from which it picks the replica of each request from this node. Rows are
  # `{pid, load, pending}`: `pending` counts requests this node sent the replica since that
  # load was published, so a burst of requests does not all pick the replica that looked
  # idlest a moment ago.

  use GenServer

  alias LlamaCppEx.Cluster
  alias LlamaCppEx.Cluster.Router

  @table __MODULE__

  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, [], name: __MODULE__)

  @doc "The last load `pid` published with this node's pending count, or nil."
  @spec lookup(pid()) :: {map(), non_neg_integer()} | nil
  def lookup(pid) do
    case :ets.lookup(@table, pid) do
      [{^pid, load, pending}] -> {load, pending}
      [] -> nil
    end
  end

  @doc """
  The members in the order to try them for a request (`LlamaCppEx.Cluster.Router.order/4`),
  the first one counted as sent. Decided here, one request at a time, so that callers
  routing at the same moment see each other's choices.
  """
  @spec claim([pid()], atom(), term(), map()) :: [pid()]
  def claim(members, route, key, conf),
    do: GenServer.call(__MODULE__, {:claim, members, route, key, conf})

  @doc "Forgets `pid` (it failed a request; `:pg` drops it from its groups soon)."
  @spec forget(pid()) :: :ok
  def forget(pid) do
    :ets.delete(@table, pid)
    :ok
  end

  @impl true
  def init([]) do
    :ets.new(@table, [
      :named_table,
      :public,
      :set,
      write_concurrency: true,
      read_concurrency: true
    ])

    :ok = :pg.join(Cluster.scope(), Cluster.directories(), self())
    # the replicas watched, so that a row goes with its replica
    {:ok, MapSet.new()}
  end

  @impl true
  def handle_call({:claim, members, route, key, conf}, _from, watched) do
    candidates =
      Enum.map(members, fn pid ->
        case lookup(pid) do
          {load, pending} -> {pid, load, pending}
          nil -> {pid, nil, 0}
        end
      end)

    order = Router.order(candidates, route, key, conf)
    pid = hd(order)
    _ = :ets.update_counter(@table, pid, {3, 1}, {pid, nil, 0})
    {:reply, order, watched}
  end

  @impl true
  def handle_info({:replica_load, pid, load}, watched) do
    :ets.insert(@table, {pid, Map.merge(load, %{node: node(pid), pid: pid}), 0})

    if MapSet.member?(watched, pid) do
      {:noreply, watched}
    else
      Process.monitor(pid)
      {:noreply, MapSet.put(watched, pid)}
    end
  end

  def handle_info({:DOWN, _, :process, pid, _}, watched) do
    :ets.delete(@table, pid)
    {:noreply, MapSet.delete(watched, pid)}
  end

  def handle_info(_msg, watched), do: {:noreply, watched}
end
