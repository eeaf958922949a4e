defmodule LlamaCppEx.ModelManager do
  @moduledoc """
  Several models resident at once, routed by id: each one either behind its own
  `LlamaCppEx.Server` (`mode: :server`, continuous batching) or used directly
  (`mode: :direct`, the default for embedding models), under one memory budget.

      children = [
        {LlamaCppEx.ModelSupervisor,
         memory_budget: :auto,
         models: [
           {"chat", {:path, "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}, default: true},
           {"embed", {:path, "/models/all-MiniLM-L6-v2"}, capabilities: [:embed]}
         ]}
      ]

      {:ok, text} = LlamaCppEx.ModelManager.generate(:default, "Hello", max_tokens: 32)
      {:ok, vector} = LlamaCppEx.ModelManager.embed("embed", "a sentence")

  The manager is a node-wide singleton (registered as `LlamaCppEx.ModelManager`; a second
  instance refuses to start). Routing reads the ETS table `:llama_cpp_ex_models`, so
  `route/1`, `fetch_model/1` and the facade calls never wait on the manager. The `:models`
  given at start load while it starts: `start_link/1` returns once each is `:ready` (or has
  failed, which is logged), so the application's next child can use them. Later `load/3`
  calls run in a `Task.Supervisor`, so a long load (or a Hub download) never blocks the
  manager, and `list/0` shows the entry as `:loading` meanwhile. If a model's server crashes,
  its entry becomes `:error` and calls get `{:error, {:not_ready, :error}}`.

  ## Memory budget

  `:memory_budget` (`:infinity` default, `:auto` = 80% of the system's RAM, bytes, or
  `%{ram: …, vram: …}`; see `LlamaCppEx.ModelManager.Budget`). A model's estimate is its
  weight bytes (the file, or a checkpoint's safetensors) plus, in server mode, 2 KiB per
  context token per slot; a load that does not fit is `{:error, {:insufficient_memory,
  device: …, required: …, available: …}}`.
  """

  use GenServer
  require Logger

  alias LlamaCppEx.Model
  alias LlamaCppEx.ModelManager.{Budget, Entry, ModelIO}
  alias LlamaCppEx.Server

  @table :llama_cpp_ex_models
  @lru :llama_cpp_ex_models_lru
  # the backend, next to the entries, for load/3's option check in the caller
  @io_key :"$io"

  ## lifecycle

  @doc """
  Starts the manager. Options: `:memory_budget`, `:models` (`{id, source}` or `{id, source,
  opts}`, loaded before this returns), `:io` (a `LlamaCppEx.ModelManager.Backend`), `:name`.
  """
  def start_link(opts \\ []) do
    {name, opts} = Keyword.pop(opts, :name, __MODULE__)
    GenServer.start_link(__MODULE__, opts, name: name)
  end

  def child_spec(opts),
    do: %{id: __MODULE__, start: {__MODULE__, :start_link, [opts]}, type: :worker}

  @impl true
  def init(opts) do
    opts = Keyword.validate!(opts, memory_budget: :infinity, models: [], io: ModelIO)

    if :ets.whereis(@table) != :undefined do
      {:stop, "LlamaCppEx.ModelManager is a node-wide singleton and one is already running"}
    else
      :ets.new(@table, [:named_table, :set, :public, read_concurrency: true])
      :ets.new(@lru, [:named_table, :set, :public])
      :ets.insert(@table, {@io_key, opts[:io]})
      {:ok, tasks} = Task.Supervisor.start_link()
      state = %{io: opts[:io], budget: Budget.resolve(opts[:memory_budget]), tasks: tasks}
      {:ok, Enum.reduce(opts[:models], Map.put(state, :loads, %{}), &auto_load/2)}
    end
  end

  # one model of `:models`, loaded here in init so that it is ready when start_link returns
  defp auto_load(model, state) do
    {id, source, opts} =
      case model do
        {id, source} -> {id, source, []}
        {id, source, o} -> {id, source, o}
      end

    case begin_load(id, source, opts) do
      {:ok, mode} ->
        reserve = fn size -> reserve(state, id, size, Keyword.put(opts, :mode, mode)) end
        result = load_now(state.io, id, source, opts, mode, reserve)
        log_auto_load(id, commit(state, id, result, opts))

      {:error, _} = error ->
        log_auto_load(id, error)
    end

    state
  end

  ## API

  @doc """
  Loads `source` (`{:path, path}` or `{:hub, repo, file}`) as `id`: `{:ok, id}` or
  `{:error, reason}` (`:already_loaded`, `{:insufficient_memory, …}`, or the loader's).

  Options: `:mode` (`:server` | `:direct`; `:direct` when `:embed` is among the
  capabilities), `:capabilities` (default `[:generate, :chat]`), `:default`, the Hub's
  download options, and any `LlamaCppEx.Model.load/2` or `LlamaCppEx.Server.start_link/1`
  option. The backend owns the option list: with `ModelIO` (the default) an unknown option
  raises `ArgumentError`, in the caller; a custom `:io` backend that exports `option_keys/0`
  is checked the same way, one that does not receives every option as given.
  """
  @spec load(term(), term(), keyword()) :: {:ok, term()} | {:error, term()}
  def load(id, source, opts \\ []) do
    with {:ok, io} <- backend() do
      if function_exported?(io, :option_keys, 0),
        do: LlamaCppEx.Options.validate!(opts, io.option_keys(), "LlamaCppEx.ModelManager.load/3")

      call({:load, id, source, opts}, :infinity)
    end
  end

  defp backend do
    with :ok <- started(), [{_, io}] <- :ets.lookup(@table, @io_key) do
      Code.ensure_loaded(io)
      {:ok, io}
    else
      _ -> {:error, :not_started}
    end
  end

  @doc "Unloads `id` (stopping its server): `:ok` or `{:error, :not_loaded}`."
  @spec unload(term(), timeout()) :: :ok | {:error, :not_loaded}
  def unload(id, timeout \\ 30_000), do: call({:unload, id}, timeout)

  @doc "Makes `id` the model `:default` routes to."
  @spec set_default(term()) :: :ok | {:error, :not_loaded}
  def set_default(id), do: call({:set_default, id}, 5_000)

  @doc "The default model's id, `nil`, or `{:error, :not_started}`."
  @spec default() :: term() | nil | {:error, :not_started}
  def default do
    with :ok <- started() do
      case :ets.lookup(@table, :"$default") do
        [{_, id}] -> id
        [] -> nil
      end
    end
  end

  @doc "Every entry (without process and resource references)."
  @spec list() :: [map()] | {:error, :not_started}
  def list do
    with :ok <- started() do
      for {_id, %Entry{} = e} <- :ets.tab2list(@table), do: Entry.to_public(e)
    end
  end

  @doc "One entry: `{:ok, map}` or `{:error, :not_loaded}`."
  @spec info(term()) :: {:ok, map()} | {:error, :not_loaded}
  def info(id) do
    case entry(id) do
      {:ok, e} -> {:ok, Entry.to_public(e)}
      error -> error
    end
  end

  @doc "Whether `id` is loaded and ready."
  @spec loaded?(term()) :: boolean()
  def loaded?(id), do: match?({:ok, %Entry{status: :ready}}, entry(id))

  @doc "The `%LlamaCppEx.Model{}` behind `id` (from its server in server mode)."
  @spec fetch_model(term()) :: {:ok, LlamaCppEx.Model.t()} | {:error, term()}
  def fetch_model(id) do
    case route(id) do
      {:ok, {:direct, model, _}} -> {:ok, model}
      {:ok, {:server, pid, _}} -> Server.fetch_model(pid)
      error -> error
    end
  end

  @doc """
  Where calls for `id` (or `:default`) go: `{:ok, {:server, pid, entry}}`,
  `{:ok, {:direct, model, entry}}`, or `{:error, :not_loaded | {:not_ready, status}}`.
  """
  @spec route(term()) :: {:ok, tuple()} | {:error, term()}
  def route(:default) do
    case default() do
      nil -> {:error, :not_loaded}
      {:error, _} = e -> e
      id -> route(id)
    end
  end

  def route(id) do
    case entry(id) do
      {:ok, %Entry{status: :ready, mode: :server, server_pid: pid} = e} ->
        touch(id)
        {:ok, {:server, pid, e}}

      {:ok, %Entry{status: :ready, model: model} = e} ->
        touch(id)
        {:ok, {:direct, model, e}}

      {:ok, %Entry{status: status}} ->
        {:error, {:not_ready, status}}

      error ->
        error
    end
  end

  ## facade

  @doc "`Server.generate/3` or `LlamaCppEx.generate/3` on the model `id` routes to."
  def generate(id, prompt, opts \\ []) do
    case route(id) do
      {:ok, {:server, pid, _}} -> Server.generate(pid, prompt, opts)
      {:ok, {:direct, model, _}} -> LlamaCppEx.generate(model, prompt, opts)
      error -> error
    end
  end

  @doc "A token stream from the model `id` routes to; raises when it cannot be routed."
  def stream(id, prompt, opts \\ []) do
    case route(id) do
      {:ok, {:server, pid, _}} -> Server.stream(pid, prompt, opts)
      {:ok, {:direct, model, _}} -> LlamaCppEx.stream(model, prompt, opts)
      error -> raise ArgumentError, "cannot stream from model #{inspect(id)}: #{inspect(error)}"
    end
  end

  @doc "Chat on the model `id` routes to (the template applied for server mode)."
  def chat(id, messages, opts \\ []) do
    case route(id) do
      {:ok, {:server, pid, _}} ->
        Server.chat(pid, messages, opts)

      {:ok, {:direct, model, _}} ->
        LlamaCppEx.chat(model, messages, opts)

      error ->
        error
    end
  end

  @doc "`LlamaCppEx.chat_completion/3` on the model or server `id` routes to."
  def chat_completion(id, messages, opts \\ []) do
    case route(id) do
      {:ok, {:server, pid, _}} -> LlamaCppEx.chat_completion(pid, messages, opts)
      {:ok, {:direct, model, _}} -> LlamaCppEx.chat_completion(model, messages, opts)
      error -> error
    end
  end

  @doc "`LlamaCppEx.stream_chat_completion/3` on `id`; raises when it cannot be routed."
  def stream_chat_completion(id, messages, opts \\ []) do
    case route(id) do
      {:ok, {:server, pid, _}} -> LlamaCppEx.stream_chat_completion(pid, messages, opts)
      {:ok, {:direct, model, _}} -> LlamaCppEx.stream_chat_completion(model, messages, opts)
      error -> raise ArgumentError, "cannot stream from model #{inspect(id)}: #{inspect(error)}"
    end
  end

  @doc """
  `LlamaCppEx.embed/3` on `id`, for a model with the `:embed` capability: a direct-mode model
  embeds on the caller's process, a server-mode one through `LlamaCppEx.Server.embed/3` (its
  texts ride in the server's generation passes); any other model gives
  `{:error, :not_embedding_model}`. (The contract allows direct mode only; server mode is
  this library's addition.)
  """
  def embed(id, text, opts \\ []) do
    case route(id) do
      {:ok, {mode, target, %Entry{capabilities: caps}}} ->
        cond do
          :embed not in caps -> {:error, :not_embedding_model}
          mode == :direct -> LlamaCppEx.embed(target, text, opts)
          true -> server_embed(target, text, opts)
        end

      error ->
        error
    end
  end

  defp server_embed(server, text, opts) do
    with {:ok, [v]} <- LlamaCppEx.Server.embed(server, [text], opts), do: {:ok, v}
  end

  ## server

  @impl true
  def handle_call({:load, id, source, opts}, from, state) do
    case begin_load(id, source, opts) do
      {:ok, mode} ->
        io = state.io
        me = self()

        # resolve (maybe download), reserve the budget, load: off the manager's process
        task =
          Task.Supervisor.async_nolink(state.tasks, fn ->
            reserve = fn size ->
              GenServer.call(me, {:reserve, id, size, Keyword.put(opts, :mode, mode)}, :infinity)
            end

            load_now(io, id, source, opts, mode, reserve)
          end)

        {:noreply, %{state | loads: Map.put(state.loads, task.ref, {id, from, opts})}}

      error ->
        {:reply, error, state}
    end
  end

  def handle_call({:reserve, id, size, opts}, _from, state),
    do: {:reply, reserve(state, id, size, opts), state}

  def handle_call({:unload, id}, _from, state) do
    case :ets.lookup(@table, id) do
      [{_, %Entry{} = e}] ->
        if e.monitor_ref, do: Process.demonitor(e.monitor_ref, [:flush])
        if e.server_pid, do: state.io.stop_server(e.server_pid)
        :ets.delete(@table, id)
        :ets.delete(@lru, id)

        if :ets.lookup(@table, :"$default") == [{:"$default", id}],
          do: :ets.delete(@table, :"$default")

        {:reply, :ok, state}

      [] ->
        {:reply, {:error, :not_loaded}, state}
    end
  end

  def handle_call({:set_default, id}, _from, state) do
    case :ets.lookup(@table, id) do
      [{_, %Entry{}}] ->
        :ets.insert(@table, {:"$default", id})
        {:reply, :ok, state}

      [] ->
        {:reply, {:error, :not_loaded}, state}
    end
  end

  @impl true
  def handle_info({ref, result}, state) when is_map_key(state.loads, ref) do
    Process.demonitor(ref, [:flush])
    {{id, from, opts}, loads} = Map.pop(state.loads, ref)
    GenServer.reply(from, commit(state, id, result, opts))
    {:noreply, %{state | loads: loads}}
  end

  # a load that raised (a backend's bug, or an option it refused): its caller gets an error
  def handle_info({:DOWN, ref, :process, _pid, reason}, state)
      when is_map_key(state.loads, ref) do
    {{id, from, _opts}, loads} = Map.pop(state.loads, ref)
    :ets.delete(@table, id)
    GenServer.reply(from, {:error, {:load_crashed, reason}})
    {:noreply, %{state | loads: loads}}
  end

  def handle_info({:DOWN, ref, :process, _pid, reason}, state) do
    for {id, %Entry{monitor_ref: ^ref}} <- :ets.tab2list(@table) do
      Logger.warning("model #{inspect(id)}: its server stopped (#{inspect(reason)})")
      update(id, &%{&1 | status: :error, error: reason, server_pid: nil, monitor_ref: nil})
    end

    {:noreply, state}
  end

  def handle_info(_msg, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    for {_id, %Entry{server_pid: pid}} when is_pid(pid) <- :ets.tab2list(@table),
        do: state.io.stop_server(pid)

    :ok
  end

  ## helpers

  # the entry a load starts with, unless `id` is taken: `{:ok, mode}`
  defp begin_load(id, source, opts) do
    if :ets.member(@table, id) do
      {:error, :already_loaded}
    else
      caps = Keyword.get(opts, :capabilities, [:generate, :chat])
      mode = Keyword.get(opts, :mode, if(:embed in caps, do: :direct, else: :server))

      entry = %Entry{
        id: id,
        status: :loading,
        mode: mode,
        source: source,
        capabilities: caps,
        # set from the loaded model (`gpu_layers/1`)
        n_gpu_layers: 0
      }

      :ets.insert(@table, {id, entry})
      {:ok, mode}
    end
  end

  # resolve (maybe download), reserve, then load or start: the backend's answer, or
  # `{:error, reason}`
  defp load_now(io, id, source, opts, mode, reserve) do
    with {:ok, path, size} <- io.resolve_source(source, opts),
         :ok <- reserve.(size) do
      case mode do
        :server -> with {:ok, pid} <- io.start_server(id, path, opts), do: {:server, pid, size}
        :direct -> with {:ok, model} <- io.load_model(path, opts), do: {:direct, model, size}
      end
    end
  rescue
    e -> {:error, {:load_crashed, {e, __STACKTRACE__}}}
  end

  defp reserve(state, id, size, opts) do
    placement = Budget.distribute(size, opts, 0)

    used =
      for {other, %Entry{est_bytes: b}} <- :ets.tab2list(@table),
          other != id,
          reduce: Budget.empty_usage() do
        acc -> Budget.add_usage(acc, %{ram: b, vram: %{}})
      end

    with :ok <- Budget.check(state.budget, placement, used) do
      update(id, &%{&1 | byte_size: size, est_bytes: placement.ram})
      :ok
    end
  end

  # layers on a GPU: all of them or none (a model runs wholly on one device)
  defp gpu_layers(%Model{} = model),
    do: if(Model.backend(model) == "CPU", do: 0, else: Model.n_layer(model))

  defp gpu_layers(_), do: 0

  defp server_gpu_layers(pid) do
    case Server.fetch_model(pid) do
      {:ok, model} -> gpu_layers(model)
      _ -> 0
    end
  catch
    # a backend's stand-in process that is not a Server
    :exit, _ -> 0
  end

  # a finished load into its entry: the caller's answer
  defp commit(state, id, result, opts) do
    now = System.system_time(:millisecond)

    case {result, :ets.lookup(@table, id)} do
      {{:server, pid, _size}, [_]} ->
        ref = Process.monitor(pid)

        update(
          id,
          &%{
            &1
            | status: :ready,
              n_gpu_layers: server_gpu_layers(pid),
              server_pid: pid,
              monitor_ref: ref,
              loaded_at: now,
              last_used: now
          }
        )

        maybe_default(id, opts)
        {:ok, id}

      {{:direct, model, _size}, [_]} ->
        update(
          id,
          &%{
            &1
            | status: :ready,
              model: model,
              n_gpu_layers: gpu_layers(model),
              loaded_at: now,
              last_used: now
          }
        )

        maybe_default(id, opts)
        {:ok, id}

      {{:server, pid, _}, []} ->
        # unloaded while loading
        state.io.stop_server(pid)
        {:error, :not_loaded}

      {{:direct, _, _}, []} ->
        {:error, :not_loaded}

      {{:error, _} = error, _} ->
        :ets.delete(@table, id)
        error

      {other, _} ->
        :ets.delete(@table, id)
        {:error, other}
    end
  end

  defp log_auto_load(_id, {:ok, _}), do: :ok

  defp log_auto_load(id, {:error, reason}),
    do: Logger.error("auto-load of #{inspect(id)} failed: #{inspect(reason)}")

  defp maybe_default(id, opts) do
    if Keyword.get(opts, :default, false) or :ets.lookup(@table, :"$default") == [],
      do: :ets.insert(@table, {:"$default", id})
  end

  defp update(id, fun) do
    case :ets.lookup(@table, id) do
      [{_, e}] -> :ets.insert(@table, {id, fun.(e)})
      [] -> :ok
    end
  end

  defp touch(id) do
    now = System.system_time(:millisecond)
    :ets.insert(@lru, {id, now})
  end

  defp entry(id) do
    with :ok <- started() do
      case :ets.lookup(@table, id) do
        [{_, %Entry{} = e}] -> {:ok, %{e | last_used: last_used(id, e)}}
        _ -> {:error, :not_loaded}
      end
    end
  end

  defp last_used(id, e) do
    case :ets.lookup(@lru, id) do
      [{_, t}] -> t
      [] -> e.last_used
    end
  end

  defp started do
    if :ets.whereis(@table) == :undefined, do: {:error, :not_started}, else: :ok
  end

  defp call(msg, timeout) do
    case Process.whereis(__MODULE__) do
      nil -> {:error, :not_started}
      pid -> GenServer.call(pid, msg, timeout)
    end
  end
end
