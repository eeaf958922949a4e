defmodule LlamaCppEx.Cluster.Proxy do
  @moduledoc false
  # Runs one request on the replica's node. The proxy watches the caller (a monitor across
  # nodes) and runs the call in a linked worker, which is the Server's subscriber: when the
  # caller dies the proxy kills the worker and the Server frees the slot within a tick; when
  # the caller halts its stream it kills the proxy, which takes the worker with it.
  #
  # To the caller (tagged with its ref): `:accepted` once the replica is alive here, then for
  # a blocking call `{:result, r}`, for a stream `{:element, e}`s and `:done` (an OpenAI
  # request answering with events: `:sse`, then those); an exception
  # raised by the call is `{:raise, e, stacktrace}`, an exit `{:exit, reason}`; a replica that
  # is not alive here is `:unavailable` (the caller may retry elsewhere).

  alias LlamaCppEx.{OpenAI, Server}

  @doc "The proxy's body, spawned on the replica's node."
  @spec start(pid(), reference(), pid(), {atom(), [term()]}) :: :ok
  def start(caller, ref, server, call) do
    caller_mon = Process.monitor(caller)

    if Process.alive?(server) do
      send(caller, {ref, :accepted})
      Process.flag(:trap_exit, true)
      worker = spawn_link(fn -> work(caller, ref, server, call) end)
      wait(caller_mon, worker, caller, ref)
    else
      send(caller, {ref, :unavailable})
      :ok
    end
  end

  defp wait(caller_mon, worker, caller, ref) do
    receive do
      {:DOWN, ^caller_mon, :process, _, _} ->
        Process.exit(worker, :kill)
        :ok

      {:EXIT, ^worker, :normal} ->
        :ok

      {:EXIT, ^worker, reason} ->
        send(caller, {ref, {:exit, reason}})
        :ok
    end
  end

  @streams [:stream, :stream_chat, :stream_chat_completion]

  defp work(caller, ref, server, {fun, args}) do
    cond do
      fun in @streams ->
        forward(run(server, fun, args), caller, ref)

      fun == :openai ->
        case run(server, fun, args) do
          {:sse, events} ->
            send(caller, {ref, :sse})
            forward(events, caller, ref)

          result ->
            send(caller, {ref, {:result, result}})
        end

      true ->
        send(caller, {ref, {:result, run(server, fun, args)}})
    end
  rescue
    e -> send(caller, {ref, {:raise, e, __STACKTRACE__}})
  catch
    :exit, reason -> send(caller, {ref, {:exit, reason}})
  end

  defp forward(stream, caller, ref) do
    Enum.each(stream, &send(caller, {ref, {:element, &1}}))
    send(caller, {ref, :done})
  end

  @doc """
  The call `fun` names, on `server`: what the worker runs on the replica's node, and what a
  caller runs against itself to apply a stream's checks before any routing (a stream
  contacts no server until it is consumed).
  """
  @spec run(GenServer.server(), atom(), [term()]) :: term()
  def run(server, :openai, [api, method, path, body]),
    do: OpenAI.handle(%{api | server: server}, method, path, body)

  def run(server, :chat_completion, [messages, opts]),
    do: LlamaCppEx.chat_completion(server, messages, opts)

  def run(server, :stream_chat_completion, [messages, opts]),
    do: LlamaCppEx.stream_chat_completion(server, messages, opts)

  def run(server, fun, args), do: apply(Server, fun, [server | args])
end
