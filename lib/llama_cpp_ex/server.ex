defmodule LlamaCppEx.Server do
  @moduledoc """
  A GenServer that serves many generation requests from one model with continuous batching:
  every tick it runs ONE forward pass holding the next token of every generating request and
  prompt chunks of new ones, and samples one token per request with that request's own
  sampler.

  ## Supervision

      children = [
        {LlamaCppEx.Server,
         name: MyApp.LLM, model_path: "SmolLM2-135M-Instruct.Q4_1.gguf", n_parallel: 4, n_ctx: 8192}
      ]

  `start_link/1` validates its options synchronously and loads the model in
  `handle_continue/2`; callers arriving during the load wait for it.

  ## Requests

      {:ok, text} = LlamaCppEx.Server.generate(MyApp.LLM, "Once upon a time", max_tokens: 64)

      MyApp.LLM
      |> LlamaCppEx.Server.stream("Tell me a story", max_tokens: 256, temp: 0.7, seed: 1)
      |> Enum.each(&IO.write/1)

  Tokenization happens in the caller. Sampling options (`:temp`, `:top_k`, `:top_p`, `:min_p`,
  `:seed`, penalties) apply per request on top of the server-wide defaults, with a fresh sampler
  per request. `:cache_prompt`, `:session` and `:cache_scope` steer prefix reuse. `:stop` takes
  stop strings (matched across token boundaries, never emitted; the request finishes with
  `:stop`); `:logprobs` / `:top_logprobs` add per-token log-probabilities to
  `complete_tokens/3`'s reply. A blocking call that times out cancels its request.

  ## Prefix reuse

  `:n_ctx` is one KV budget shared by all slots (paged blocks). A new request reuses the
  longest cached prefix of its own slot or of ANY other slot in the same `:cache_scope`
  (idle, prefilling or generating) by sharing KV blocks, never re-evaluating those tokens; at
  least one prompt token is always evaluated. Idle slots keep their cache (unless
  `cache_prompt: false`); when blocks run out, idle caches are evicted least recently used
  first before any active request fails, and a request that still does not fit fails alone with
  `{:error, :context_full}`.

  ## Non-blocking

  Forward passes run on an engine thread fed through a channel; the result comes back as a
  message, so the server keeps admitting, cancelling and answering `get_stats/1` while the
  engine computes.

  ## Telemetry

  Emitted through `:telemetry` when the application includes it:

    * `[:llama_cpp_ex, :server, :tick]` - `batch_size`, `decode_tokens`, `prefill_tokens`,
      `active_slots`, `queue_depth`, `eval_ms`; metadata `server`.
    * `[:llama_cpp_ex, :server, :request, :start]` - `prompt_tokens`, `prefix_cache_tokens`;
      metadata `server`, `seq_id`, `mode`.
    * `[:llama_cpp_ex, :server, :request, :done]` - `prompt_tokens`, `generated_tokens`,
      `duration_ms`, `ttft_ms`, `prompt_eval_rate`, `generation_rate`, `prefix_cache_tokens`,
      `prefix_cache_ratio`; metadata `server`, `seq_id`, `mode`, `stop_reason`.
    * `[:llama_cpp_ex, :server, :request, :exception]` - as `:done`, with `reason`.
    * `[:llama_cpp_ex, :server, :kv_pressure]` - `purged_slots`, `batch_splits`.
    * `[:llama_cpp_ex, :server, :prefix_instability]` - `matched_tokens`, `cached_tokens`.
  """

  use GenServer
  require Logger

  alias LlamaCppEx.{
    Context,
    Model,
    NIF,
    Options,
    Sampler,
    StopMatcher,
    Telemetry,
    Tokenizer,
    UTF8Stream
  }

  alias LlamaCppEx.Server.{Request, Slots}

  @own_keys [
    :model_path,
    :n_gpu_layers,
    :requantize,
    :n_parallel,
    :n_ctx,
    :n_batch,
    :chunk_size,
    :max_queue,
    :cache_prompt,
    :kv_unified,
    :prompt_cache_ram_mb,
    :batch_strategy
  ]
  @request_keys [:cache_prompt, :session, :cache_scope, :stop]
  @call_keys [:max_tokens, :timeout]
  @prefix_instability_min 64

  @doc "Options `start_link/1` accepts (besides `:name`)."
  @spec start_option_keys() :: [atom()]
  def start_option_keys do
    Enum.uniq(
      @own_keys ++
        Sampler.option_keys() ++
        Sampler.extra_keys() ++ Model.tuning_option_keys() ++ Context.tuning_option_keys()
    )
  end

  @doc "Per-request options."
  @spec request_option_keys() :: [atom()]
  def request_option_keys,
    do: @request_keys ++ Sampler.option_keys() ++ Sampler.logprob_keys() ++ Sampler.extra_keys()

  @doc false
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, __MODULE__), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Starts a server.

  ## Options

    * `:model_path` (required) - a GGUF file.
    * `:n_parallel` - slots (concurrent requests). Default 4.
    * `:n_ctx` - KV budget in tokens shared by all slots. Default 8192.
    * `:n_batch` - token budget of one forward pass. Default `min(n_ctx, 2048)`.
    * `:chunk_size` - most prompt tokens one slot feeds per tick. Default 512.
    * `:max_queue` - waiting requests beyond the free slots; 0 = unlimited. Default 64.
    * `:cache_prompt` - keep a finished request's KV for prefix reuse. Default `true`.
    * `:kv_unified` - allow cross-slot prefix sharing. Default `true`.
    * `:batch_strategy` - a `LlamaCppEx.Server.BatchStrategy`. Default
      `LlamaCppEx.Server.Strategy.DecodeMaximal`.
    * `:n_threads` and other context tuning options, `:requantize` and model tuning options,
      and server-wide sampler defaults (`:temp`, `:top_k`, ...).
    * `:prompt_cache_ram_mb` - accepted; the level-2 RAM cache is not implemented (0).

  Unknown options raise `ArgumentError` in the caller.
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    {name, opts} = Keyword.pop(opts, :name)
    Options.validate!(opts, start_option_keys(), "LlamaCppEx.Server.start_link/1")
    gen_opts = if name, do: [name: name], else: []
    GenServer.start_link(__MODULE__, opts, gen_opts)
  end

  # ------------------------------------------------------------------ client

  @doc "Generates text for `prompt` (tokenized in the caller)."
  @spec generate(GenServer.server(), String.t(), keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def generate(server, prompt, opts \\ []) do
    validate_call!(opts, "generate/3")

    with {:ok, ids} <- tokenize(server, prompt) do
      call_generate(server, ids, opts, :text)
    end
  end

  @doc "Like `generate/3` with token ids."
  @spec generate_tokens(GenServer.server(), [non_neg_integer()], keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def generate_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "generate_tokens/3")
    call_generate(server, ids, opts, :text)
  end

  @doc """
  Like `generate_tokens/3`, returning
  `{:ok, %{text: t, completion_tokens: n, finish_reason: :eog | :max_tokens}}`.
  """
  @spec complete_tokens(GenServer.server(), [non_neg_integer()], keyword()) ::
          {:ok, map()} | {:error, term()}
  def complete_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "complete_tokens/3")
    call_generate(server, ids, opts, :full)
  end

  defp call_generate(server, ids, opts, mode) do
    {max_tokens, timeout, req_opts} = split_call_opts(opts)
    ref = make_ref()

    try do
      GenServer.call(server, {:generate_tokens, ids, max_tokens, req_opts, mode, ref}, timeout)
    catch
      :exit, {:timeout, _} = reason ->
        # the request may have been admitted after we gave up: do not leave it running
        cancel(server, ref)
        exit(reason)
    end
  end

  @doc """
  Streams generated text chunks. `:timeout` (default 30_000 ms) bounds admission and the wait
  for each chunk. Rejections, errors and timeouts are a single `{:error, reason}` element, after
  which the stream halts; halting early cancels the request within one tick.
  """
  @spec stream(GenServer.server(), String.t(), keyword()) :: Enumerable.t()
  def stream(server, prompt, opts \\ []) do
    validate_call!(opts, "stream/3")
    stream_resource(server, fn -> tokenize(server, prompt) end, opts)
  end

  @doc "Like `stream/3` with token ids."
  @spec stream_tokens(GenServer.server(), [non_neg_integer()], keyword()) :: Enumerable.t()
  def stream_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "stream_tokens/3")
    stream_resource(server, fn -> {:ok, ids} end, opts)
  end

  @doc false
  def subscribe_stream_tokens(server, ids, ref, opts \\ []) do
    {max_tokens, timeout, req_opts} = split_call_opts(opts, :stream)

    try do
      GenServer.call(server, {:stream_tokens, ids, max_tokens, req_opts, self(), ref}, timeout)
    catch
      :exit, {:timeout, _} ->
        cancel(server, ref)
        {:error, :timeout}

      :exit, reason ->
        {:error, exit_reason(reason)}
    end
  end

  @doc "Cancels the request streaming to `ref` (or removes it from the queue)."
  @spec cancel(GenServer.server(), reference()) :: :ok
  def cancel(server, ref), do: GenServer.cast(server, {:cancel, ref})

  @doc "The server's model, once loaded."
  @spec fetch_model(GenServer.server()) :: {:ok, Model.t()} | {:error, term()}
  def fetch_model(server) do
    with pid when is_pid(pid) <- GenServer.whereis(server),
         [{_, model}] <- Registry.lookup(LlamaCppEx.Registry, {__MODULE__, pid}) do
      {:ok, model}
    else
      nil ->
        {:error, :noproc}

      _ ->
        try do
          GenServer.call(server, :fetch_model, 5_000)
        catch
          :exit, {:timeout, _} -> {:error, :not_ready}
          :exit, reason -> {:error, exit_reason(reason)}
        end
    end
  end

  @doc "Like `fetch_model/1`, raising `ArgumentError` when no model is available."
  @spec get_model(GenServer.server()) :: Model.t()
  def get_model(server) do
    case fetch_model(server) do
      {:ok, model} ->
        model

      {:error, reason} ->
        raise ArgumentError,
              "LlamaCppEx.Server.get_model/1: no model available for #{inspect(server)} " <>
                "(#{inspect(reason)}). Use fetch_model/1 to handle this."
    end
  end

  @doc """
  Slot and queue counters plus throughput: `active_slots`, `idle_slots`, `prefilling_slots`,
  `queue_depth`, `n_parallel`, `n_batch`, `ram_cache_entries`, `ram_cache_bytes`,
  `tokens_generated` (since start), `requests_completed`, and `window_tokens`, `window_ms`,
  `tokens_per_second` over the window since start or the last `reset_stats_window/1`.
  """
  @spec get_stats(GenServer.server()) :: map()
  def get_stats(server), do: GenServer.call(server, :get_stats)

  @doc "Restarts the throughput window of `get_stats/1`."
  @spec reset_stats_window(GenServer.server()) :: :ok
  def reset_stats_window(server), do: GenServer.call(server, :reset_stats_window)

  @doc """
  KV audit, answered once the engine is idle: verifies block reference counts and returns
  `%{n_blocks: n, used: [blocks per layer group], owners: [[{seq_id, blocks}]],
  cached_tokens: %{seq_id => tokens}}`.
  """
  @spec kv_audit(GenServer.server(), timeout()) :: {:ok, map()} | {:error, term()}
  def kv_audit(server, timeout \\ 60_000), do: GenServer.call(server, :kv_audit, timeout)

  defp validate_call!(opts, fun) do
    Options.validate!(opts, request_option_keys() ++ @call_keys, "LlamaCppEx.Server.#{fun}")
  end

  defp split_call_opts(opts, mode \\ :blocking) do
    {max_tokens, opts} = Keyword.pop(opts, :max_tokens, 256)
    timeout = Options.timeout(opts, mode)
    {max_tokens, timeout, Keyword.delete(opts, :timeout)}
  end

  defp tokenize(server, prompt) do
    with {:ok, model} <- fetch_model(server) do
      Tokenizer.encode(model, prompt)
    end
  end

  defp exit_reason({reason, {GenServer, :call, _}}), do: exit_reason(reason)
  defp exit_reason(r) when r in [:normal, :noproc, :killed, :shutdown], do: :noproc
  defp exit_reason({:shutdown, _}), do: :noproc
  defp exit_reason({:nodedown, _}), do: :noproc
  defp exit_reason(other), do: other

  defp stream_resource(server, tokens_fun, opts) do
    timeout = Options.timeout(opts, :stream)

    Stream.resource(
      fn ->
        ref = make_ref()

        with {:ok, ids} <- tokens_fun.(),
             :ok <- subscribe_stream_tokens(server, ids, ref, opts) do
          {:running, server, ref, timeout}
        else
          {:error, reason} -> {:failed, reason}
        end
      end,
      &stream_next/1,
      &stream_after/1
    )
  end

  defp stream_next({:failed, reason}), do: {[{:error, reason}], :halted}
  defp stream_next(:halted), do: {:halt, :halted}
  defp stream_next({:finished, _, _} = s), do: {:halt, s}

  defp stream_next({:running, server, ref, timeout} = s) do
    receive do
      {^ref, {:token, piece}} -> {[piece], s}
      {^ref, {:logprob, _}} -> stream_next(s)
      {^ref, {:done, _reason}} -> {:halt, {:finished, server, ref}}
      {^ref, {:error, reason}} -> {[{:error, reason}], {:finished, server, ref}}
    after
      timeout ->
        cancel(server, ref)
        {[{:error, :timeout}], {:finished, server, ref}}
    end
  end

  defp stream_after({:running, server, ref, _}) do
    cancel(server, ref)
    LlamaCppEx.Generator.drain(ref)
  end

  defp stream_after({:finished, _server, ref}), do: LlamaCppEx.Generator.drain(ref)
  defp stream_after(_), do: :ok

  # ------------------------------------------------------------------ server

  @impl true
  def init(opts) do
    strategy = Keyword.get(opts, :batch_strategy, LlamaCppEx.Server.Strategy.DecodeMaximal)

    with {:ok, path} <- validate_path(Keyword.fetch(opts, :model_path)),
         :ok <- validate_strategy(strategy) do
      n_ctx = Keyword.get(opts, :n_ctx, 8192)

      state = %{
        opts: opts,
        model_path: path,
        model: nil,
        ctx: nil,
        engine: nil,
        strategy: strategy,
        n_parallel: Keyword.get(opts, :n_parallel, 4),
        n_ctx: n_ctx,
        n_batch: Keyword.get(opts, :n_batch, min(n_ctx, 2048)),
        chunk_size: Keyword.get(opts, :chunk_size, 512),
        max_queue: Keyword.get(opts, :max_queue, 64),
        cache_prompt: Keyword.get(opts, :cache_prompt, true),
        kv_unified: Keyword.get(opts, :kv_unified, true),
        sampler_defaults: Keyword.take(opts, Sampler.option_keys() ++ Sampler.extra_keys()),
        swa_window: 0,
        slots: %{},
        queue: :queue.new(),
        sessions: %{},
        in_flight: nil,
        tick_scheduled: false,
        tick: 0,
        pending_ops: [],
        audits: [],
        warned_instability: false,
        stats: new_stats()
      }

      {:ok, state, {:continue, :load}}
    else
      {:error, reason} -> {:stop, reason}
    end
  end

  defp validate_path(:error), do: {:error, {:missing_option, :model_path}}
  defp validate_path({:ok, p}) when not is_binary(p), do: {:error, {:invalid_model_path, p}}

  defp validate_path({:ok, p}) do
    if File.regular?(p), do: {:ok, p}, else: {:error, {:model_not_found, p}}
  end

  defp validate_strategy(mod) when not is_atom(mod) or is_nil(mod),
    do: {:error, {:invalid_batch_strategy, mod}}

  defp validate_strategy(mod) do
    cond do
      not Code.ensure_loaded?(mod) ->
        {:error, {:invalid_batch_strategy, {:module_not_available, mod}}}

      not function_exported?(mod, :build_batch, 4) ->
        {:error, {:invalid_batch_strategy, {:build_batch_4_not_exported, mod}}}

      true ->
        :ok
    end
  end

  @impl true
  def handle_continue(:load, state) do
    opts = state.opts
    model_opts = Keyword.take(opts, Model.tuning_option_keys() ++ [:n_gpu_layers, :requantize])

    ctx_opts =
      opts
      |> Keyword.take(Context.tuning_option_keys())
      |> Keyword.merge(n_ctx: state.n_ctx, n_batch: state.n_batch, n_seq_max: state.n_parallel)

    with :ok <- check_positive(state),
         {:ok, model} <- Model.load(state.model_path, model_opts),
         {:ok, ctx} <- Context.create(model, ctx_opts),
         {:ok, engine} <- start_engine(ctx) do
      Process.flag(:trap_exit, true)
      {:ok, _} = Registry.register(LlamaCppEx.Registry, {__MODULE__, self()}, model)
      slots = Map.new(0..(state.n_parallel - 1), &{&1, idle_slot()})
      window = NIF.model_swa_window(model.ref)

      {:noreply,
       %{state | model: model, ctx: ctx, engine: engine, slots: slots, swa_window: window}}
    else
      {:error, reason} -> {:stop, {:load_failed, reason}, state}
    end
  end

  defp check_positive(state) do
    bad =
      Enum.find([:n_parallel, :n_ctx, :n_batch, :chunk_size], fn k ->
        v = Map.fetch!(state, k)
        not (is_integer(v) and v > 0)
      end)

    cond do
      bad -> {:error, "#{bad} must be a positive integer"}
      not (is_integer(state.max_queue) and state.max_queue >= 0) -> {:error, "invalid max_queue"}
      true -> :ok
    end
  end

  defp start_engine(ctx) do
    {:ok, NIF.engine_start(ctx.ref)}
  rescue
    e -> {:error, Exception.message(e)}
  end

  defp idle_slot do
    %{
      state: :idle,
      from: nil,
      stream_pid: nil,
      stream_ref: nil,
      monitor_ref: nil,
      reply_mode: :text,
      cache_prompt: true,
      prompt_tokens: [],
      prompt_tokens_tuple: {},
      prefill_pos: 0,
      pos: 0,
      pending_token: nil,
      pending_eog: false,
      batch_idx: -1,
      tokens_generated: 0,
      max_tokens: 0,
      accumulated_pieces: [],
      utf8_pending: "",
      t_start: nil,
      t_first_token: nil,
      n_prompt_tokens: 0,
      cached_tokens: [],
      cached_pos: 0,
      cache_scope: nil,
      generated_token_ids: [],
      n_prefix_cache_tokens: 0,
      sampler: nil,
      t_last_used: 0,
      session: nil,
      stop_matcher: nil,
      stop_hit: false,
      token_logprobs: []
    }
  end

  defp new_stats do
    now = now_ms()

    %{
      tokens_generated: 0,
      requests_completed: 0,
      window_start: now,
      window_tokens: 0
    }
  end

  # ---- calls

  @impl true
  def handle_call(:fetch_model, _from, %{model: nil} = state),
    do: {:reply, {:error, :not_ready}, state}

  def handle_call(:fetch_model, _from, state), do: {:reply, {:ok, state.model}, state}

  def handle_call(:get_stats, _from, state), do: {:reply, stats(state), state}

  def handle_call(:reset_stats_window, _from, state) do
    stats = %{state.stats | window_start: now_ms(), window_tokens: 0}
    {:reply, :ok, %{state | stats: stats}}
  end

  def handle_call(:kv_audit, from, state) do
    {:noreply, maybe_answer_audits(%{state | audits: [from | state.audits]})}
  end

  def handle_call({:generate_tokens, ids, max, opts, mode, ref}, from, state) do
    request = %{
      Request.sync(ids, max, Keyword.put(opts, :reply_mode, mode), from)
      | stream_ref: ref
    }

    case admit(state, request) do
      {:ok, state} -> {:noreply, state}
      {:error, reason} -> {:reply, {:error, reason}, state}
    end
  end

  def handle_call({:stream_tokens, ids, max, opts, pid, ref}, _from, state) do
    case admit(state, Request.stream(ids, max, opts, pid, ref)) do
      {:ok, state} -> {:reply, :ok, state}
      {:error, reason} -> {:reply, {:error, reason}, state}
    end
  end

  @impl true
  def handle_cast({:cancel, ref}, state) do
    case Enum.find(state.slots, fn {_, s} -> s.state != :idle and s.stream_ref == ref end) do
      {seq, _} ->
        {:noreply, state |> finish_slot(seq, :cancelled) |> schedule_tick()}

      nil ->
        {dropped, queue} = split_queue(state.queue, &(&1.stream_ref == ref))
        Enum.each(dropped, &demonitor/1)
        {:noreply, %{state | queue: queue}}
    end
  end

  # ---- admission

  defp admit(state, %Request{tokens: ids, max_tokens: max} = request) do
    with :ok <- check_request(state, ids, max, request.opts),
         :ok <- check_capacity(state),
         {:ok, sampler} <- request_sampler(state, request.opts) do
      consumer = Request.consumer_pid(request)
      mref = if consumer, do: Process.monitor(consumer)
      request = %{request | monitor_ref: mref, opts: Keyword.put(request.opts, :sampler, sampler)}
      {:ok, schedule_tick(%{state | queue: :queue.in(request, state.queue)})}
    end
  end

  defp check_request(%{model: nil}, _ids, _max, _opts), do: {:error, :not_ready}
  defp check_request(_state, [], _max, _opts), do: {:error, :empty_prompt}

  defp check_request(state, ids, max, opts) do
    n_vocab = Tokenizer.vocab_size(state.model)

    cond do
      not StopMatcher.valid?(Keyword.get(opts, :stop)) ->
        {:error, {:invalid_stop, Keyword.get(opts, :stop)}}

      not is_list(ids) ->
        {:error, :invalid_tokens}

      not (is_integer(max) and max > 0) ->
        {:error, {:invalid_max_tokens, max}}

      Enum.any?(ids, &(not is_integer(&1) or &1 < 0 or &1 >= n_vocab)) ->
        {:error, :invalid_token}

      true ->
        :ok
    end
  end

  defp check_capacity(state) do
    idle = Enum.count(state.slots, fn {_, s} -> s.state == :idle end)
    waiting = :queue.len(state.queue) - idle

    if state.max_queue > 0 and waiting >= state.max_queue,
      do: {:error, :queue_full},
      else: :ok
  end

  defp request_sampler(state, opts) do
    request =
      Keyword.take(opts, Sampler.option_keys() ++ Sampler.logprob_keys() ++ Sampler.extra_keys())

    sampler_opts = Keyword.merge(state.sampler_defaults, request)

    Sampler.create(state.model, sampler_opts)
  end

  # ---- tick loop

  defp schedule_tick(%{tick_scheduled: true} = state), do: state
  defp schedule_tick(%{in_flight: f} = state) when f != nil, do: state

  defp schedule_tick(state) do
    send(self(), :tick)
    %{state | tick_scheduled: true}
  end

  defp has_work?(state) do
    Enum.any?(state.slots, fn {_, s} -> s.state != :idle end) or
      not :queue.is_empty(state.queue) or state.pending_ops != []
  end

  @impl true
  def handle_info(:tick, state) do
    state = %{state | tick_scheduled: false}

    if state.in_flight != nil or state.model == nil do
      {:noreply, state}
    else
      state = state |> finish_completed() |> dequeue()
      {:noreply, state |> submit() |> maybe_answer_audits()}
    end
  end

  def handle_info(
        {ref, {:ok, sampled, purged, n_splits, failed, eval_us}},
        %{in_flight: %{ref: ref}} = state
      ) do
    flight = state.in_flight
    state = %{state | in_flight: nil}
    state = apply_purged(state, purged)
    state = Enum.reduce(failed, state, &fail_seq(&2, &1, :context_full))
    state = Enum.reduce(sampled, state, &apply_sample/2)
    slots = Map.new(state.slots, fn {seq, s} -> {seq, %{s | batch_idx: -1}} end)
    state = %{state | slots: slots}

    if purged != [] or n_splits > 0 do
      Telemetry.execute(
        [:llama_cpp_ex, :server, :kv_pressure],
        %{purged_slots: length(purged), batch_splits: n_splits},
        %{server: self(), purged_seq_ids: purged}
      )
    end

    Telemetry.execute(
      [:llama_cpp_ex, :server, :tick],
      %{
        batch_size: flight.decode + flight.prefill,
        decode_tokens: flight.decode,
        prefill_tokens: flight.prefill,
        active_slots: Enum.count(state.slots, fn {_, s} -> s.state != :idle end),
        queue_depth: :queue.len(state.queue),
        eval_ms: eval_us / 1000
      },
      %{server: self()}
    )

    state = if has_work?(state), do: schedule_tick(state), else: state
    {:noreply, maybe_answer_audits(state)}
  end

  def handle_info({ref, {:error, reason}}, %{in_flight: %{ref: ref}} = state) do
    state = %{state | in_flight: nil}

    state =
      state.slots
      |> Enum.filter(fn {_, s} -> s.state != :idle end)
      |> Enum.reduce(state, fn {seq, _}, st -> fail_seq(st, seq, {:inference_failed, reason}) end)

    state = if has_work?(state), do: schedule_tick(state), else: state
    {:noreply, maybe_answer_audits(state)}
  end

  def handle_info({:DOWN, mref, :process, _pid, _reason}, state) do
    state =
      state.slots
      |> Enum.filter(fn {_, s} -> s.state != :idle and s.monitor_ref == mref end)
      |> Enum.reduce(state, fn {seq, _}, st -> finish_slot(st, seq, :cancelled) end)

    {_dropped, queue} = split_queue(state.queue, &(&1.monitor_ref == mref))
    {:noreply, schedule_tick(%{state | queue: queue})}
  end

  def handle_info({:EXIT, _pid, reason}, state), do: {:stop, reason, state}

  def handle_info(msg, state) do
    Logger.debug("LlamaCppEx.Server ignored #{inspect(msg)}")
    {:noreply, state}
  end

  @impl true
  def terminate(_reason, %{engine: engine}) when engine != nil do
    NIF.engine_stop(engine)
    :ok
  end

  def terminate(_reason, _state), do: :ok

  # ---- finishing

  defp finish_completed(state) do
    Enum.reduce(state.slots, state, fn {seq, s}, st ->
      cond do
        s.state == :idle ->
          st

        s.stop_hit ->
          finish_slot(st, seq, :stop)

        s.pending_eog ->
          finish_slot(st, seq, :eog)

        s.state == :generating and s.tokens_generated >= s.max_tokens ->
          finish_slot(st, seq, :max_tokens)

        true ->
          st
      end
    end)
  end

  defp finish_slot(state, seq, reason) do
    slot = Map.fetch!(state.slots, seq)
    slot = if reason == :stop, do: slot, else: flush_pending(slot)
    now = now_ms()
    text = IO.iodata_to_binary(slot.accumulated_pieces)

    cond do
      slot.stream_pid != nil and reason != :cancelled ->
        send(slot.stream_pid, {slot.stream_ref, {:done, reason}})

      slot.from != nil and reason != :cancelled ->
        reply =
          if slot.reply_mode == :full,
            do: full_reply(slot, text, reason),
            else: text

        GenServer.reply(slot.from, {:ok, reply})

      true ->
        :ok
    end

    if slot.monitor_ref, do: Process.demonitor(slot.monitor_ref, [:flush])
    emit_done(state, seq, slot, reason, now)
    state = update_stats(state, slot)
    release_slot(state, seq, slot, now)
  end

  defp full_reply(slot, text, reason) do
    reply = %{text: text, completion_tokens: slot.tokens_generated, finish_reason: reason}

    case slot.token_logprobs do
      [] -> reply
      lps -> Map.put(reply, :logprobs, Enum.reverse(lps))
    end
  end

  defp fail_seq(state, seq, reason) do
    slot = Map.fetch!(state.slots, seq)

    if slot.state == :idle do
      # A request cancelled while its tokens were in flight; its cache is no longer reliable.
      clear_cache(state, seq)
    else
      cond do
        slot.stream_pid != nil -> send(slot.stream_pid, {slot.stream_ref, {:error, reason}})
        slot.from != nil -> GenServer.reply(slot.from, {:error, reason})
        true -> :ok
      end

      if slot.monitor_ref, do: Process.demonitor(slot.monitor_ref, [:flush])
      now = now_ms()

      Telemetry.execute(
        [:llama_cpp_ex, :server, :request, :exception],
        done_measurements(slot, now),
        %{server: self(), seq_id: seq, mode: mode(slot), stop_reason: :error, reason: reason}
      )

      state = release_slot(state, seq, slot, now)
      clear_cache(state, seq)
    end
  end

  defp clear_cache(state, seq) do
    slots = Map.update!(state.slots, seq, &%{&1 | cached_tokens: [], cached_pos: 0})
    %{state | slots: slots, pending_ops: state.pending_ops ++ [{:clear, seq}]}
  end

  defp release_slot(state, seq, slot, now) do
    cached = if slot.cache_prompt, do: Slots.fed_tokens(slot), else: []

    idle = %{
      idle_slot()
      | cached_tokens: cached,
        cached_pos: length(cached),
        cache_scope: slot.cache_scope,
        t_last_used: now,
        session: slot.session
    }

    ops = if slot.cache_prompt, do: state.pending_ops, else: state.pending_ops ++ [{:clear, seq}]
    %{state | slots: Map.put(state.slots, seq, idle), pending_ops: ops}
  end

  defp flush_pending(slot) do
    held = if slot.stop_matcher, do: StopMatcher.flush(slot.stop_matcher), else: ""
    emit_piece(%{slot | utf8_pending: "", stop_matcher: nil}, held <> slot.utf8_pending)
  end

  defp emit_text(%{stop_matcher: nil} = slot, text), do: emit_piece(slot, text)

  defp emit_text(%{stop_matcher: m} = slot, text) do
    case StopMatcher.push(m, text) do
      {:cont, emit, m} -> emit_piece(%{slot | stop_matcher: m}, emit)
      {:stop, emit} -> emit_piece(%{slot | stop_matcher: nil, stop_hit: true}, emit)
    end
  end

  defp emit_piece(slot, ""), do: slot

  defp emit_piece(%{stream_pid: pid} = slot, piece) when is_pid(pid) do
    send(pid, {slot.stream_ref, {:token, piece}})
    slot
  end

  defp emit_piece(slot, piece), do: %{slot | accumulated_pieces: [slot.accumulated_pieces, piece]}

  defp mode(slot), do: if(slot.stream_pid, do: :stream, else: :generate)

  defp done_measurements(slot, now) do
    duration = max(now - (slot.t_start || now), 0)
    ttft = if slot.t_first_token, do: slot.t_first_token - slot.t_start, else: duration
    evaluated = slot.n_prompt_tokens - slot.n_prefix_cache_tokens
    gen_ms = if slot.t_first_token, do: now - slot.t_first_token, else: 0

    %{
      prompt_tokens: slot.n_prompt_tokens,
      generated_tokens: slot.tokens_generated,
      duration_ms: duration,
      ttft_ms: ttft,
      prompt_eval_rate: if(ttft > 0, do: evaluated * 1000 / ttft, else: 0.0),
      generation_rate:
        if(gen_ms > 0, do: max(slot.tokens_generated - 1, 0) * 1000 / gen_ms, else: 0.0),
      prefix_cache_tokens: slot.n_prefix_cache_tokens,
      prefix_cache_ratio:
        if(slot.n_prompt_tokens > 0,
          do: slot.n_prefix_cache_tokens / slot.n_prompt_tokens,
          else: 0.0
        )
    }
  end

  defp emit_done(_state, seq, slot, reason, now) do
    Telemetry.execute(
      [:llama_cpp_ex, :server, :request, :done],
      done_measurements(slot, now),
      %{server: self(), seq_id: seq, mode: mode(slot), stop_reason: reason}
    )
  end

  defp update_stats(state, slot) do
    s = state.stats

    %{
      state
      | stats: %{
          s
          | tokens_generated: s.tokens_generated + slot.tokens_generated,
            requests_completed: s.requests_completed + 1,
            window_tokens: s.window_tokens + slot.tokens_generated
        }
    }
  end

  defp stats(state) do
    counts = Enum.frequencies_by(state.slots, fn {_, s} -> s.state end)
    active = Map.get(counts, :prefilling, 0) + Map.get(counts, :generating, 0)
    window_ms = max(now_ms() - state.stats.window_start, 1)
    # Tokens of requests still running count toward throughput too.
    running = state.slots |> Enum.map(fn {_, s} -> s.tokens_generated end) |> Enum.sum()

    %{
      active_slots: active,
      idle_slots: Map.get(counts, :idle, 0),
      prefilling_slots: Map.get(counts, :prefilling, 0),
      queue_depth: :queue.len(state.queue),
      n_parallel: state.n_parallel,
      n_batch: state.n_batch,
      ram_cache_entries: 0,
      ram_cache_bytes: 0,
      tokens_generated: state.stats.tokens_generated + running,
      requests_completed: state.stats.requests_completed,
      window_tokens: state.stats.window_tokens,
      window_ms: window_ms,
      tokens_per_second: state.stats.window_tokens * 1000 / window_ms
    }
  end

  # ---- dequeue and slot initialisation

  defp dequeue(state) do
    idle = Enum.filter(state.slots, fn {_, s} -> s.state == :idle end)

    if idle == [] or :queue.is_empty(state.queue) do
      state
    else
      {request, queue, seq} = next_request(state, idle)
      state = init_slot(%{state | queue: queue}, seq, request)
      dequeue(state)
    end
  end

  defp session_key(opts) do
    case Keyword.get(opts, :session) do
      nil -> nil
      session -> {Keyword.get(opts, :cache_scope), session}
    end
  end

  defp next_request(state, idle) do
    list = :queue.to_list(state.queue)

    by_session =
      Enum.find_value(list, fn r ->
        seq = Slots.session_slot_if_idle(state.sessions, session_key(r.opts), idle)
        if seq, do: {r, seq}
      end)

    case by_session do
      {r, seq} ->
        {r, :queue.from_list(List.delete(list, r)), seq}

      nil ->
        {{:value, r}, queue} = :queue.out(state.queue)
        {r, queue, acquire_slot(state, idle, r)}
    end
  end

  defp acquire_slot(state, idle, request) do
    cache_prompt = Keyword.get(request.opts, :cache_prompt, state.cache_prompt)

    case cache_prompt && Slots.pick_cached_slot(idle, request.tokens) do
      {seq, lcp} when lcp > 0 -> seq
      _ -> Slots.pick_lru_slot(idle)
    end
  end

  defp init_slot(state, seq, %Request{} = r) do
    old = Map.fetch!(state.slots, seq)
    n = length(r.tokens)
    scope = Keyword.get(r.opts, :cache_scope)
    cache_prompt = Keyword.get(r.opts, :cache_prompt, state.cache_prompt)

    own =
      if cache_prompt and old.cache_scope == scope,
        do: min(Slots.common_prefix_length(old.cached_tokens, r.tokens), n - 1),
        else: 0

    own =
      if Slots.prefix_usable?(length(old.cached_tokens), own, state.swa_window), do: own, else: 0

    {donor, donor_len} =
      if cache_prompt and state.kv_unified,
        do: best_donor(state, seq, scope, r.tokens, n),
        else: {nil, 0}

    {match, ops} =
      cond do
        donor != nil and donor_len > own -> {donor_len, [{:share, donor, seq, donor_len}]}
        length(old.cached_tokens) > own -> {own, [{:trim, seq, own}]}
        true -> {own, []}
      end

    maybe_prefix_instability(state, seq, old, own, n)
    now = now_ms()

    slot = %{
      old
      | state: :prefilling,
        from: r.from,
        stream_pid: r.stream_pid,
        stream_ref: r.stream_ref,
        monitor_ref: r.monitor_ref,
        reply_mode: Keyword.get(r.opts, :reply_mode, :text),
        cache_prompt: cache_prompt,
        prompt_tokens: r.tokens,
        prompt_tokens_tuple: List.to_tuple(r.tokens),
        prefill_pos: match,
        pos: match,
        pending_token: nil,
        pending_eog: false,
        batch_idx: -1,
        tokens_generated: 0,
        max_tokens: r.max_tokens,
        accumulated_pieces: [],
        utf8_pending: "",
        t_start: now,
        t_first_token: nil,
        n_prompt_tokens: n,
        cached_tokens: [],
        cached_pos: 0,
        cache_scope: scope,
        generated_token_ids: [],
        n_prefix_cache_tokens: match,
        sampler: Keyword.fetch!(r.opts, :sampler),
        t_last_used: now,
        session: Keyword.get(r.opts, :session),
        stop_matcher: StopMatcher.new(Keyword.get(r.opts, :stop)),
        stop_hit: false,
        token_logprobs: []
    }

    sessions =
      case session_key(r.opts) do
        nil -> state.sessions
        key -> Map.put(state.sessions, key, seq)
      end

    Telemetry.execute(
      [:llama_cpp_ex, :server, :request, :start],
      %{prompt_tokens: n, prefix_cache_tokens: match},
      %{server: self(), seq_id: seq, mode: mode(slot)}
    )

    %{
      state
      | slots: Map.put(state.slots, seq, slot),
        sessions: sessions,
        pending_ops: state.pending_ops ++ ops
    }
  end

  defp best_donor(state, seq, scope, tokens, n) do
    state.slots
    |> Enum.reject(fn {s, slot} -> s == seq or slot.cache_scope != scope end)
    |> Enum.map(fn {s, slot} -> {s, min(Slots.donor_prefix_match(slot, tokens), n - 1)} end)
    |> Enum.filter(fn {_, len} -> len > 0 end)
    |> Enum.filter(fn {s, len} ->
      Slots.prefix_usable?(Slots.fed_length(state.slots[s]), len, state.swa_window)
    end)
    |> Enum.max_by(fn {s, len} -> {len, -s} end, fn -> {nil, 0} end)
  end

  # A prompt that diverges early from a long cached conversation suggests a template that
  # rewrites earlier turns; a prompt that is itself a prefix of the cache (the same prompt sent
  # again, a shorter one) rewrote nothing.
  defp maybe_prefix_instability(state, seq, old, matched, prompt_len) do
    cached = length(old.cached_tokens)

    if cached >= @prefix_instability_min and matched * 10 >= cached and matched * 2 <= cached and
         matched < prompt_len - 1 do
      Telemetry.execute(
        [:llama_cpp_ex, :server, :prefix_instability],
        %{matched_tokens: matched, cached_tokens: cached},
        %{server: self(), seq_id: seq}
      )

      unless state.warned_instability do
        Logger.warning(
          "LlamaCppEx.Server: a request matched only #{matched} of #{cached} cached tokens; " <>
            "a chat template may be rewriting earlier turns"
        )
      end
    end
  end

  # ---- submitting and applying

  defp submit(state) do
    q = :queue.len(state.queue)
    opts = [model_ref: state.model.ref, queue_depth: q, tick: state.tick]

    {entries, slots} =
      state.strategy.build_batch(state.slots, state.n_batch, state.chunk_size, opts)

    if entries == [] and state.pending_ops == [] do
      %{state | slots: slots}
    else
      samplers = for {seq, s} <- slots, s.batch_idx >= 0, do: {seq, s.sampler.ref}

      purgeable =
        slots
        |> Enum.filter(fn {_, s} -> s.state == :idle and s.cached_tokens != [] end)
        |> Enum.sort_by(fn {seq, s} -> {s.t_last_used, seq} end)
        |> Enum.map(&elem(&1, 0))

      ref = make_ref()

      :ok =
        NIF.engine_submit(
          state.engine,
          self(),
          ref,
          state.pending_ops,
          entries,
          samplers,
          purgeable
        )

      decode =
        Enum.count(entries, fn {_, _, seq, _} ->
          Map.fetch!(state.slots, seq).state == :generating
        end)

      %{
        state
        | slots: slots,
          pending_ops: [],
          tick: state.tick + 1,
          in_flight: %{ref: ref, decode: decode, prefill: length(entries) - decode}
      }
    end
  end

  defp apply_purged(state, purged) do
    slots =
      Enum.reduce(purged, state.slots, fn seq, slots ->
        Map.update!(slots, seq, &%{&1 | cached_tokens: [], cached_pos: 0})
      end)

    %{state | slots: slots}
  end

  defp apply_sample({seq, token, piece, eog, logprobs}, state) do
    slot = Map.fetch!(state.slots, seq)

    if slot.state == :idle do
      state
    else
      now = now_ms()

      slot =
        case slot.state do
          :prefilling ->
            %{slot | state: :generating, pos: slot.n_prompt_tokens, t_first_token: now}

          :generating ->
            %{slot | pos: slot.pos + 1}
        end

      slot = %{
        slot
        | pending_token: if(eog or slot.stop_hit, do: nil, else: token),
          pending_eog: eog,
          tokens_generated: slot.tokens_generated + 1,
          token_logprobs:
            if(logprobs && not eog,
              do: [{piece, logprobs} | slot.token_logprobs],
              else: slot.token_logprobs
            )
      }

      if logprobs && not eog && slot.stream_pid,
        do: send(slot.stream_pid, {slot.stream_ref, {:logprob, {piece, logprobs}}})

      slot =
        if eog do
          slot
        else
          {emit, pending} = UTF8Stream.push(slot.utf8_pending, piece)
          emit_text(%{slot | utf8_pending: pending}, emit)
        end

      %{state | slots: Map.put(state.slots, seq, slot)}
    end
  end

  defp maybe_answer_audits(%{audits: []} = state), do: state

  defp maybe_answer_audits(state) do
    if state.in_flight == nil and state.pending_ops == [] and not has_work?(state) do
      reply =
        with {:ok, usage} <- Context.kv_usage(state.ctx) do
          cached = Map.new(state.slots, fn {seq, s} -> {seq, length(s.cached_tokens)} end)
          {:ok, Map.put(usage, :cached_tokens, cached)}
        end

      Enum.each(state.audits, &GenServer.reply(&1, reply))
      %{state | audits: []}
    else
      state
    end
  end

  defp split_queue(queue, pred) do
    {dropped, kept} = queue |> :queue.to_list() |> Enum.split_with(pred)
    {dropped, :queue.from_list(kept)}
  end

  defp demonitor(%Request{monitor_ref: nil}), do: :ok
  defp demonitor(%Request{monitor_ref: ref}), do: Process.demonitor(ref, [:flush])

  # Milliseconds since the VM started: monotonic and non-negative, so a never-used slot (0)
  # always counts as least recently used.
  defp now_ms do
    start = System.convert_time_unit(:erlang.system_info(:start_time), :native, :millisecond)
    System.monotonic_time(:millisecond) - start
  end
end
