defmodule LlamaCppEx.Chat.Renderer do
  @moduledoc false
  # Owns the helper process that renders chat templates (native/engine/src/bin/
  # llama_cpp_ex_render.rs) through a port, one request at a time, in arrival order. When the
  # helper dies (a template that exhausted its memory, outlived its deadline or crashed it),
  # the request it was rendering gets an error and the next request starts a fresh helper.

  use GenServer

  @deadline_ms 10_000
  @call_timeout 60_000

  @doc false
  def deadline_ms, do: @deadline_ms

  def start_link(_opts), do: GenServer.start_link(__MODULE__, nil, name: __MODULE__)

  @doc "Renders one request (JSON iodata, see the helper's protocol)."
  @spec render(iodata()) :: {:ok, String.t()} | {:error, String.t()}
  def render(request) do
    GenServer.call(__MODULE__, {:render, request}, @call_timeout)
  catch
    :exit, reason ->
      {:error, "chat template failed: the renderer did not answer (#{inspect(reason)})"}
  end

  @impl true
  def init(nil), do: {:ok, %{port: nil, busy: nil, queue: :queue.new()}}

  @impl true
  def handle_call({:render, request}, from, state) do
    {:noreply, next(%{state | queue: :queue.in({from, request}, state.queue)})}
  end

  @impl true
  def handle_info({port, {:data, <<0, prompt::binary>>}}, %{port: port} = state) do
    {:noreply, answer(state, {:ok, prompt})}
  end

  def handle_info({port, {:data, <<1, message::binary>>}}, %{port: port} = state) do
    {:noreply, answer(state, {:error, message})}
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    state = %{state | port: nil}

    state =
      if state.busy,
        do:
          answer(
            state,
            {:error,
             "chat template failed: the template renderer stopped (exit status #{status}): " <>
               "the template exhausted its memory, ran past #{@deadline_ms} ms or crashed it"}
          ),
        else: state

    {:noreply, state}
  end

  def handle_info(_other, state), do: {:noreply, state}

  defp answer(%{busy: from} = state, reply) do
    GenServer.reply(from, reply)
    next(%{state | busy: nil})
  end

  defp next(%{busy: nil} = state) do
    case :queue.out(state.queue) do
      {:empty, _} ->
        state

      {{:value, {from, request}}, queue} ->
        state = %{ensure_port(state) | queue: queue}

        case state.port do
          nil ->
            GenServer.reply(
              from,
              {:error, "chat template failed: cannot start the template renderer"}
            )

            next(state)

          port ->
            Port.command(port, request)
            %{state | busy: from}
        end
    end
  end

  defp next(state), do: state

  defp ensure_port(%{port: nil} = state) do
    path = Path.join(:code.priv_dir(:llama_cpp_ex), "native/llama_cpp_ex_render")

    port = Port.open({:spawn_executable, path}, [:binary, {:packet, 4}, :exit_status, :use_stdio])

    %{state | port: port}
  rescue
    _ -> state
  end

  defp ensure_port(state), do: state
end
