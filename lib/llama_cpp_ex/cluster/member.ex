defmodule LlamaCppEx.Cluster.Member do
  @moduledoc false
  # A Server's side of a cluster: the `:pg` groups it is in, and the load signal it publishes
  # to every node's `LlamaCppEx.Cluster.Directory` (when it changed, at most every
  # `publish_ms`, and at least every `heartbeat_ms` so that nodes joining later learn it).

  alias LlamaCppEx.Cluster
  alias LlamaCppEx.Server.{Placement, State}

  @type t :: %__MODULE__{
          groups: [term()],
          last: map() | nil,
          last_at: integer(),
          timer?: boolean()
        }
  defstruct groups: [], last: nil, last_at: 0, timer?: false

  @doc "Joins `group` (idempotent) and publishes the load at once."
  @spec join(State.t(), term()) :: State.t()
  def join(%State{cluster: m} = st, group) do
    if group in m.groups do
      st
    else
      :ok = :pg.join(Cluster.scope(), group, self())
      publish(%{st | cluster: %{m | groups: [group | m.groups], last: nil}})
    end
  end

  @doc "Leaves `group` (a no-op when not in it)."
  @spec leave(State.t(), term()) :: State.t()
  def leave(%State{cluster: m} = st, group) do
    if group in m.groups do
      :ok = :pg.leave(Cluster.scope(), group, self())
      %{st | cluster: %{m | groups: List.delete(m.groups, group)}}
    else
      st
    end
  end

  @doc "Sends the load to every directory when it changed or the heartbeat is due; re-arms."
  @spec publish(State.t()) :: State.t()
  def publish(%State{cluster: %__MODULE__{groups: []} = m} = st),
    do: %{st | cluster: %{m | timer?: false}}

  def publish(%State{cluster: m} = st) do
    conf = Cluster.config()
    load = load(st)
    now = System.monotonic_time(:millisecond)

    m =
      if load != m.last or now - m.last_at >= conf[:heartbeat_ms] do
        msg = {:replica_load, self(), Map.put(load, :groups, m.groups)}
        Enum.each(:pg.get_members(Cluster.scope(), Cluster.directories()), &send(&1, msg))
        %{m | last: load, last_at: now}
      else
        m
      end

    m =
      if m.timer? do
        m
      else
        Process.send_after(self(), :cluster_publish, conf[:publish_ms])
        %{m | timer?: true}
      end

    %{st | cluster: m}
  end

  @doc "The timer fired: publish and re-arm."
  @spec tick(State.t()) :: State.t()
  def tick(%State{cluster: m} = st), do: publish(%{st | cluster: %{m | timer?: false}})

  defp load(st) do
    busy = Enum.count(st.slots, fn {_, s} -> s.state in [:prefilling, :generating] end)

    %{
      free_slots: st.config.n_parallel - busy,
      n_parallel: st.config.n_parallel,
      queue_depth: :queue.len(st.queue),
      # what a new request can have: free blocks and the idle caches it may evict
      kv_free_tokens: st.kv_free + Placement.evictable_tokens(st),
      n_ctx: st.config.n_ctx,
      model: Path.basename(st.config.model_path)
    }
  end
end
