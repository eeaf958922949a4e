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

  Tokenization, option checks and the request's sampler (its grammar compiled) happen in the
  caller, so a malformed request fails alone, in its caller, and never reaches the server.
  Sampling options (`:temp`, `:top_k`, `:top_p`, `:min_p`, `:seed`, penalties, ...) apply per
  request on top of the server-wide defaults. `:cache_prompt`, `:session` and `:cache_scope`
  steer prefix reuse. `:stop` takes stop strings (matched across token boundaries, never
  emitted; the request finishes with `:stop`); `:logprobs` / `:top_logprobs` add per-token
  log-probabilities to `complete_tokens/3`'s reply. `:speculative` turns on lossless
  speculative decoding for the request: `[n_draft: 8]` drafts by prompt lookup, `[mode:
  :draft]` with the Server's `:draft_model` (drafts of all such requests in one batched
  draft pass per position); the drafts are extra rows of the tick's forward pass.
  `:add_assistant`, `:enable_thinking` and `:chat_template_kwargs` are accepted, as
  `llama_cpp_ex` accepts them, and have no effect on a raw prompt.

  A request is prepared against the server's model, whose memory lives on the server's node:
  a server on another node is reached through `LlamaCppEx.Cluster` (called directly, its
  requests answer `{:error, {:remote_server, node}}`).

  Every request streams its events to its caller; blocking calls (`generate/3`,
  `complete_tokens/3`) collect them there. `:timeout` bounds the wait for each event
  (default 60_000 ms for blocking calls, 30_000 ms for streams): past it a stream ends with
  `{:error, :timeout}`, a blocking call exits with `{:timeout, _}` (as a `GenServer.call`
  would), and either way the request is cancelled. A request whose caller halts its stream,
  times out or dies frees its slot within one tick. A server that dies ends every request in
  flight with `{:error, :server_down}`.

  ## Prefix reuse

  `:n_ctx` is one KV budget shared by all slots (paged blocks). A new request reuses the
  longest cached prefix of its own slot or of ANY other slot in the same `:cache_scope`
  (idle, prefilling or generating) by sharing KV blocks, never re-evaluating those tokens; at
  least one prompt token is always evaluated. Idle slots keep their cache (unless
  `cache_prompt: false`); when blocks run out, idle caches are evicted least recently used
  first before any active request fails, and a request that still does not fit fails alone with
  `{:error, :context_full}`. Admission checks capacity first: a prompt as long as `:n_ctx` is
  refused with `{:error, :context_full}` at once, and a queued request whose prompt the cache
  cannot take now (free blocks plus evictable idle caches, less what active requests still
  need) waits in the queue for requests to finish instead of taking a slot and failing
  mid-prompt.

  ## Prompt cache beyond the KV budget

  With `prompt_cache_ram_mb: mb`, a slot's cache that is about to be lost (another request
  takes the slot, or KV pressure evicts it) is first copied to host RAM, in the KV cache's
  own block types, when it holds at least 32 tokens no entry already covers. A later request
  whose prompt starts with an entry's tokens (same `:cache_scope`, at least a quarter of the
  entry matched) gets those blocks copied back instead of evaluating them; a slot's own cache
  and other slots' blocks are preferred when they match as much. Entries are evicted oldest
  first to stay within `mb`. `save_prefix/4` writes a cached prefix to disk and
  `load_prefix/3` puts it in a server's RAM cache (e.g. a long system prompt at start-up).
  `get_stats/1` reports `ram_cache_entries`, `ram_cache_bytes`, `ram_cache_budget_bytes`,
  `ram_cache_hits`, `ram_cache_saves` and `ram_cache_evictions`; every save, restore and
  eviction is a `[:llama_cpp_ex, :server, :ram_cache]` telemetry event.

  ## Non-blocking

  Forward passes run on an engine thread fed through a channel; the result comes back as a
  message, so the server keeps admitting, cancelling and answering `get_stats/1` while the
  engine computes. While every active request is generating and nothing else waits, the next
  decode step is queued behind the one running (`:overlap`): the engine feeds it the tokens
  the running step samples and goes straight on to it, while the server hands out the
  running step's tokens. A request that ends on a stop string (or is cancelled) then costs
  its queued row; one reaching `:max_tokens` or an end-of-generation token costs nothing. A
  request that arrives meanwhile is placed after the queued step, one step later than
  without it. The engine's threads share the cores with the BEAM's schedulers, which
  spin when idle by default; a node that runs little else besides the server gains from
  starting the VM with `+sbwt none +sbwtdcpu none +sbwtdio none` (many streams wake the
  schedulers every tick: ~1.2× the 8-stream decode on 2 vCPUs, `docs/performance.md`).

  ## Telemetry

  Emitted through `:telemetry` when the application includes it:

    * `[:llama_cpp_ex, :server, :tick]` - `batch_size`, `decode_tokens`, `prefill_tokens`,
      `embed_tokens`, `active_slots`, `queue_depth`, `eval_ms`; metadata `server`, `queued`
      (whether the step was queued behind the one before it, `:overlap`).
    * `[:llama_cpp_ex, :server, :request, :start]` - `prompt_tokens`, `prefix_cache_tokens`;
      metadata `server`, `seq_id`, `mode` (`:generate` for a blocking call, `:stream` for a
      stream).
    * `[:llama_cpp_ex, :server, :request, :done]` - `prompt_tokens`, `generated_tokens`,
      `duration_ms`, `ttft_ms`, `prompt_eval_rate`, `generation_rate`, `prefix_cache_tokens`,
      `prefix_cache_ratio`; metadata `server`, `seq_id`, `mode`, `stop_reason` (`:eog`,
      `:max_tokens`, `:stop` or `:cancelled`).
    * `[:llama_cpp_ex, :server, :request, :exception]` - as `:done`, with `reason`.
    * `[:llama_cpp_ex, :server, :embed, :done]` - `texts`, `tokens`, `duration_ms` of an
      `embed/3` call; metadata `server`. `[:llama_cpp_ex, :server, :embed, :exception]` - the
      same, with `reason` in the metadata.
    * `[:llama_cpp_ex, :server, :pause]` - no measurements; metadata `server`, `level`
      (`:none | :prefill | :full`, the level now in effect), `previous`, `manual`.
    * `[:llama_cpp_ex, :server, :kv_pressure]` - `purged_slots`, `batch_splits`.
    * `[:llama_cpp_ex, :server, :kv_precision]` - `occupancy`, `ewma` (0..1); metadata
      `server`, `from`, `to` (`:f16 | :q8_0 | :q4_0`): the `:kv_policy` changed the precision
      of new KV blocks.
    * `[:llama_cpp_ex, :server, :prefix_instability]` - `matched_tokens`, `cached_tokens`.
    * `[:llama_cpp_ex, :server, :ram_cache]` - `bytes`, `tokens` (of the entry saved or
      evicted, restored tokens for a restore), `total_bytes`, `entries` (after the
      operation); metadata `server`, `op` (`:save`, `:restore` or `:evict`).
    * `[:llama_cpp_ex, :server, :strategy, :exception]` - `count` (1); metadata `server`,
      `strategy`, `kind`, `reason`: the `:batch_strategy` failed and `DecodeMaximal` planned
      the tick (see `LlamaCppEx.Server.BatchStrategy`).
  """

  use GenServer
  require Logger

  alias LlamaCppEx.{Chat, Context, Embedding, Generation, Model, NIF, Options, Sampler, Source}

  alias LlamaCppEx.Cluster.Member

  alias LlamaCppEx.Server.{
    Config,
    EmbedJob,
    Embeds,
    KvPolicy,
    Placement,
    PrefixFile,
    PromptCache,
    Request,
    Slot,
    State,
    Stats,
    Tick
  }

  @request_keys [:cache_prompt, :session, :cache_scope, :stop, :speculative]
  # the chat keys as the contract's calls accept them: a raw prompt ignores them
  @call_keys [:max_tokens, :timeout, :add_assistant, :chat_template_kwargs, :enable_thinking]

  @doc "Options `start_link/1` accepts (besides `:name`)."
  @spec start_option_keys() :: [atom()]
  def start_option_keys, do: Config.keys()

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
    * `:kv_budget_mb` - the KV budget in MiB instead: `:n_ctx` becomes what that memory holds
      in the chosen `:type_k` / `:type_v` (so `:q8_0` fits about 1.9× the tokens of `:f16`,
      `:q4_0` about 3.6×); `get_stats/1` reports the resulting `n_ctx`.
    * `:n_batch` - token budget of one forward pass. Default `min(n_ctx, 2048)`.
    * `:chunk_size` - most prompt tokens one slot feeds per tick. Default 512.
    * `:max_queue` - waiting requests beyond the free slots; 0 = unlimited. Default 64. It
      bounds waiting `embed/3` calls too.
    * `:embed_parallel` - most embedding texts one forward pass carries (each is a KV
      sequence of its own for that pass). Default 32.
    * `:embed_chunk` - most embedding tokens a pass carries while requests are generating
      (every generating request waits for the whole pass, so this bounds the inter-token
      latency embeddings add); a text longer than it goes whole. Without generation,
      embeddings take up to half of `:n_batch`. Default 64.
    * `:pause_policy` - a `LlamaCppEx.Server.PausePolicy` module (or `{module, arg}`)
      consulted before every forward pass; `:pause_poll_ms` (default 100) is how often it is
      asked again while it holds the server paused. Default none.
    * `:cache_prompt` - keep a finished request's KV for prefix reuse. Default `true`.
    * `:kv_unified` - allow cross-slot prefix sharing. Default `true`.
    * `:batch_strategy` - a `LlamaCppEx.Server.BatchStrategy`. Default
      `LlamaCppEx.Server.Strategy.DecodeMaximal`.
    * `:overlap` - queue the next decode step behind the running one (see "Non-blocking").
      It applies with the built-in strategies and without a `:pause_policy` (which is asked
      before every step); with others it is a no-op. Default `true`.
    * `:n_threads` and other context tuning options, `:requantize`, `:quantize` (Hugging
      Face directories) and model tuning options, and server-wide sampler defaults (`:temp`,
      `:top_k`, ...).
    * `:prompt_cache_ram_mb` - host RAM for the level-2 prompt cache (see "Prompt cache
      beyond the KV budget"). Default 0 (off).
    * `:draft_model` - a `LlamaCppEx.Model` or GGUF path sharing the model's vocabulary, for
      requests with `speculative: [mode: :draft]`. Its context mirrors the server's (`n_ctx`,
      sequences, KV types), so it adds its own KV bytes on top of `:kv_budget_mb`. A draft
      model with another vocabulary fails the start. Default `nil`.
    * `:cluster` - a `:pg` group (any term, usually an atom per model) the server joins once
      its model is loaded, as a replica `LlamaCppEx.Cluster` routes requests to. Default
      `nil`.
    * `:kv_policy` - `[]` (or `true`) or options: new KV blocks are written in f16 while the
      cache has room and in `q8_0`, then `q4_0`, as it fills (an EWMA of occupancy with
      hysteresis), within the same byte budget; see `LlamaCppEx.Server.KvPolicy`. Invalid
      thresholds give `{:error, {:invalid_kv_policy, message}}`. Default `nil` (one precision,
      `:type_k` / `:type_v`).

  Unknown options raise `ArgumentError` in the caller.
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    {name, opts} = Keyword.pop(opts, :name)
    Options.validate!(opts, start_option_keys(), "LlamaCppEx.Server.start_link/1")
    # unknown keys of a nested option list raise here, in the caller, like the top-level ones
    with policy when is_list(policy) <- opts[:kv_policy], do: KvPolicy.new(policy)
    gen_opts = if name, do: [name: name], else: []
    GenServer.start_link(__MODULE__, opts, gen_opts)
  end

  # ------------------------------------------------------------------ client

  @doc "Generates text for `prompt` (tokenized in the caller)."
  @spec generate(GenServer.server(), String.t(), keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def generate(server, prompt, opts \\ []) do
    validate_call!(opts, "generate/3")
    with {:ok, %{text: text}} <- run(server, prompt, opts), do: {:ok, text}
  end

  @doc "Like `generate/3` with token ids."
  @spec generate_tokens(GenServer.server(), [non_neg_integer()], keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def generate_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "generate_tokens/3")
    with {:ok, %{text: text}} <- run(server, ids, opts), do: {:ok, text}
  end

  @doc """
  Like `generate_tokens/3`, returning `{:ok, %{text: t, completion_tokens: n, finish_reason:
  :eog | :max_tokens | :stop}}` (plus `logprobs: [...]` when asked for).
  """
  @spec complete_tokens(GenServer.server(), [non_neg_integer()], keyword()) ::
          {:ok, map()} | {:error, term()}
  def complete_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "complete_tokens/3")

    with {:ok, r} <- run(server, ids, opts) do
      reply = %{text: r.text, completion_tokens: r.completion_tokens, finish_reason: r.reason}
      {:ok, if(r.logprobs == [], do: reply, else: Map.put(reply, :logprobs, r.logprobs))}
    end
  end

  @doc """
  Applies the model's chat template to `messages` (see `LlamaCppEx.Chat.apply_template/3`
  for messages and its options) and generates the reply as `generate/3` does.
  """
  @spec chat(GenServer.server(), [LlamaCppEx.Chat.message()], keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def chat(server, messages, opts \\ []) do
    {chat_opts, opts} = Keyword.split(opts, Chat.option_keys())
    validate_call!(opts, "chat/3")

    with {:ok, %{text: text}} <- run(server, &Chat.apply_template(&1, messages, chat_opts), opts),
         do: {:ok, text}
  end

  @doc "Like `chat/3`, streaming text chunks as `stream/3` does."
  @spec stream_chat(GenServer.server(), [LlamaCppEx.Chat.message()], keyword()) ::
          Enumerable.t()
  def stream_chat(server, messages, opts \\ []) do
    {chat_opts, opts} = Keyword.split(opts, Chat.option_keys())
    validate_call!(opts, "stream_chat/3")
    stream_of(server, &Chat.apply_template(&1, messages, chat_opts), opts)
  end

  # A blocking call that times out exits like the GenServer call it replaces (the contract's
  # behaviour), after cancelling its request. `prompt` is the text or ids, or a function
  # rendering them from the model.
  defp run(server, prompt, opts) do
    timeout = Options.timeout(opts, :blocking)
    opts = Generation.options!(Keyword.delete(opts, :timeout), :server)

    result =
      with {:ok, src, _gen} <- open(server, renderer(prompt), opts, :generate, timeout) do
        Source.collect(src)
      end

    case result do
      {:error, :timeout} -> exit({:timeout, {__MODULE__, :call, [server, timeout]}})
      other -> other
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
    stream_of(server, prompt, opts)
  end

  @doc "Like `stream/3` with token ids."
  @spec stream_tokens(GenServer.server(), [non_neg_integer()], keyword()) :: Enumerable.t()
  def stream_tokens(server, ids, opts \\ []) do
    validate_call!(opts, "stream_tokens/3")
    stream_of(server, ids, opts)
  end

  defp stream_of(server, prompt, opts) do
    timeout = Options.timeout(opts, :stream)
    opts = Generation.options!(Keyword.delete(opts, :timeout), :server)

    LlamaCppEx.text_stream(fn ->
      with {:ok, src, _gen} <- open(server, renderer(prompt), opts, :stream, timeout) do
        {:ok, src}
      end
    end)
  end

  defp renderer(render) when is_function(render, 1), do: render
  defp renderer(prompt), do: fn _model -> {:ok, prompt} end

  @doc false
  # Prepares a request (`LlamaCppEx.Generation`) in the caller against the server's model and
  # config, fetched once, and admits it: `{:ok, source, generation}`. `prompt` renders the
  # prompt from the model (a chat template, or the text or ids as they are), perhaps with
  # options it adds (a tool-call constraint); `opts` went through `Generation.options!/2`;
  # `mode` is the telemetry's.
  @spec open(
          GenServer.server(),
          (Model.t() ->
             {:ok, String.t() | [integer()]}
             | {:ok, String.t() | [integer()], keyword()}
             | {:error, term()}),
          keyword(),
          Request.mode(),
          timeout()
        ) :: {:ok, Source.t(), Generation.t()} | {:error, term()}
  def open(server, prompt, opts, mode, timeout) do
    with {:ok, pid, model, config} <- fetch_model_and_config(server),
         {:ok, prompt, extra} <- rendered(prompt.(model)),
         opts = extra ++ opts,
         {:ok, gen} <- Generation.prepare(model, prompt, opts, {:server, config}),
         {:ok, src} <- Source.server(pid, gen, Keyword.put(opts, :mode, mode), timeout) do
      {:ok, src, gen}
    end
  end

  defp rendered({:ok, prompt}), do: {:ok, prompt, []}
  defp rendered(other), do: other

  @doc false
  # The contract's raw subscription: the request's events (`LlamaCppEx.Pipeline.event/0`,
  # and `{:usage, map}` before `{:done, reason}`) go to the caller as `{ref, event}`.
  @spec subscribe_stream_tokens(GenServer.server(), [non_neg_integer()], reference(), keyword()) ::
          :ok | {:error, term()}
  def subscribe_stream_tokens(server, ids, ref, opts \\ []) do
    Options.validate!(
      opts,
      request_option_keys() ++ @call_keys,
      "LlamaCppEx.Server.subscribe_stream_tokens/4"
    )

    timeout = Options.timeout(opts, :stream)
    opts = Generation.options!(Keyword.delete(opts, :timeout), :server)

    with {:ok, pid, model, config} <- fetch_model_and_config(server),
         {:ok, gen} <- Generation.prepare(model, ids, opts, {:server, config}) do
      subscribe(pid, gen, ref, Keyword.put(opts, :mode, :stream), timeout)
    end
  end

  @doc false
  # Admits a prepared request whose events go to this process tagged with `ref`.
  @spec subscribe(pid(), Generation.t(), reference(), keyword(), timeout()) ::
          :ok | {:error, term()}
  def subscribe(pid, %Generation{} = gen, ref, opts, timeout) do
    call(pid, {:subscribe, Request.new(gen, opts, self(), ref)}, timeout, ref)
  end

  defp call(server, message, timeout, ref) do
    GenServer.call(server, message, timeout)
  catch
    :exit, {:timeout, _} ->
      # admitted after we gave up: do not leave it running
      cancel(server, ref)
      {:error, :timeout}

    :exit, reason ->
      {:error, exit_reason(reason)}
  end

  @doc """
  Embeddings of `texts` (a list of strings), in order: `{:ok, [vector]}` or
  `{:error, reason}`.

  The texts ride in the server's forward passes next to the tokens of generating requests
  (each text is a sequence of its own for one pass, its final-normed hidden states pooled
  there), so embedding and generation share the model and the machine instead of competing
  for them; no slot is taken and nothing stays in the KV cache after the reply. While
  requests generate, a pass carries up to `:embed_chunk` embedding tokens (default 64) next
  to their decode rows, bounding what embeddings add to their inter-token latency; otherwise
  waiting texts get up to half of `:n_batch` before prompt chunks. A server whose model is
  an encoder (BERT) serves embeddings only.

      {:ok, [a, b]} = LlamaCppEx.Server.embed(MyApp.LLM, ["cats purr", "dogs bark"])

  Options: `:pooling_type`, `:normalize`, `:format`, `:n_ctx`, `:truncate` as
  `LlamaCppEx.Embedding` (a text longer than `min(n_ctx, n_batch)` tokens is an error unless
  `truncate: true`), and `:timeout` (default 60_000 ms for the whole call; past it the call is
  cancelled and returns `{:error, :timeout}`). Errors: `{:error, :queue_full}` when
  `:max_queue` calls already wait, `{:error, :context_full}` when the KV budget cannot hold a
  text, a message for bad input, `{:error, :server_down}` when the server dies.
  """
  @spec embed(GenServer.server(), [String.t()], keyword()) ::
          {:ok, [Embedding.t() | [Embedding.t()]]} | {:error, term()}
  def embed(server, texts, opts \\ []) when is_list(texts) do
    timeout = Options.timeout(opts, :blocking)
    opts = Keyword.delete(opts, :timeout)
    label = "LlamaCppEx.Server.embed/3"

    with {:ok, _pid, model, %{n_batch: n_batch}} <- fetch_model_and_config(server),
         {:ok, ids, opts} <- Embedding.prepare(model, texts, opts, label, [], n_batch),
         :ok <- check_lengths(ids, opts[:n_ctx]) do
      if ids == [] do
        {:ok, []}
      else
        ref = make_ref()
        job = EmbedJob.new(ids, Embedding.pooling_code(opts), opts[:normalize], self(), ref)
        await_embeddings(server, job, timeout, model, opts)
      end
    end
  end

  defp check_lengths(ids, max) do
    case Enum.find_index(ids, &(length(&1) > max)) do
      nil ->
        :ok

      i ->
        {:error,
         "text #{i} has #{length(Enum.at(ids, i))} tokens, more than #{max} (n_ctx, n_batch)"}
    end
  end

  defp await_embeddings(server, job, timeout, model, opts) do
    deadline = System.monotonic_time(:millisecond) + timeout
    ref = job.ref
    mon = Process.monitor(GenServer.whereis(server) || server)

    result =
      with :ok <- call(server, {:embed, job}, timeout, ref) do
        left = max(deadline - System.monotonic_time(:millisecond), 0)

        receive do
          {^ref, {:ok, bins}} -> {:ok, Embedding.decode(bins, model, opts)}
          {^ref, {:error, reason}} -> {:error, reason}
          {:DOWN, ^mon, :process, _, _} -> {:error, :server_down}
        after
          left ->
            cancel(server, ref)
            {:error, :timeout}
        end
      end

    Process.demonitor(mon, [:flush])
    # a reply that raced the timeout
    receive do
      {^ref, _} -> :ok
    after
      0 -> :ok
    end

    result
  end

  @doc """
  Pauses the server: `:full` (default) runs no forward pass, `:prefill` keeps decoding the
  requests already generating but evaluates no prompt chunk and no embedding text. Queued and
  active requests are kept; their callers' timeouts still apply. A `:full` pause returns
  once it holds: after the step in flight, if any, has finished and delivered its tokens, so
  no token is generated from then until `resume/1`. `get_stats/1` shows `paused: true`, and
  time in a full pause is left out of its `tokens_per_second`. A `:pause_policy` (see
  `LlamaCppEx.Server.PausePolicy`) may pause further, never less.
  """
  @spec pause(GenServer.server(), :full | :prefill) :: :ok
  def pause(server, level \\ :full) when level in [:full, :prefill],
    do: GenServer.call(server, {:pause, level}, :infinity)

  @doc "Ends a `pause/2` (a `:pause_policy` may still hold the server paused)."
  @spec resume(GenServer.server()) :: :ok
  def resume(server), do: GenServer.call(server, {:pause, :none})

  @doc """
  Writes the KV cache of a prompt prefix (text, tokenized like `generate/3`'s prompt, or
  token ids) to `path`, so a server of the same model can start with it in its RAM prompt
  cache (`load_prefix/3`) instead of evaluating it, e.g. a long system prompt every
  conversation shares. The prefix is copied from a slot that holds it; when none does, it is
  evaluated first (one `complete_tokens/3` with `max_tokens: 1`).

  Options: `:cache_scope` (the scope the prefix is cached in and restored for; default
  `nil`), `:timeout` (default 60_000 ms).

      :ok = LlamaCppEx.Server.save_prefix(MyApp.LLM, system_prompt, "system.prefix")

  Errors: `{:error, :not_cached}` when no slot kept the prefix (e.g. evicted at once under
  KV pressure), `{:error, :timeout}`, `{:error, :empty_prompt}`, `{:error, :invalid_token}`,
  file errors.
  """
  @spec save_prefix(GenServer.server(), String.t() | [non_neg_integer()], Path.t(), keyword()) ::
          :ok | {:error, term()}
  def save_prefix(server, prompt, path, opts \\ []) do
    Options.validate!(opts, [:cache_scope, :timeout], "LlamaCppEx.Server.save_prefix/4")
    scope = Keyword.get(opts, :cache_scope)
    timeout = Options.timeout(opts, :blocking)

    with {:ok, model} <- fetch_model(server),
         {:ok, ids} <- Generation.tokens(model, prompt),
         {:ok, {tokens, scope, ref, _bytes}} <- copy_prefix(server, ids, scope, timeout) do
      PrefixFile.write(path, model, tokens, scope, ref)
    end
  end

  defp copy_prefix(server, ids, scope, timeout) do
    case plain_call(server, {:save_prefix, ids, scope}, timeout) do
      {:error, :not_cached} ->
        opts = [max_tokens: 1, cache_scope: scope, timeout: timeout]

        with {:ok, _} <- complete_tokens(server, ids, opts),
             do: plain_call(server, {:save_prefix, ids, scope}, timeout)

      other ->
        other
    end
  end

  @doc """
  Loads a prefix written by `save_prefix/4` into the server's RAM prompt cache (the server
  needs a `:prompt_cache_ram_mb` large enough for it): a request whose prompt starts with the
  prefix, in the same `:cache_scope`, gets those tokens' KV restored instead of evaluated.
  The file must come from the same model with the same KV cache types.

  Options: `:timeout` (default 60_000 ms).

  Errors: `{:error, :model_mismatch}`, `{:error, :invalid_prefix_file}`,
  `{:error, :prompt_cache_disabled}`, `{:error, {:prompt_cache_too_small, bytes}}`, a message
  when the KV cache types differ, file errors.
  """
  @spec load_prefix(GenServer.server(), Path.t(), keyword()) :: :ok | {:error, term()}
  def load_prefix(server, path, opts \\ []) do
    Options.validate!(opts, [:timeout], "LlamaCppEx.Server.load_prefix/3")
    timeout = Options.timeout(opts, :blocking)

    with {:ok, model} <- fetch_model(server),
         {:ok, prefix} <- PrefixFile.read(path, model) do
      plain_call(server, {:load_prefix, prefix}, timeout)
    end
  end

  defp plain_call(server, message, timeout) do
    GenServer.call(server, message, timeout)
  catch
    :exit, {:timeout, _} -> {:error, :timeout}
    :exit, reason -> {:error, exit_reason(reason)}
  end

  @doc "Cancels the request streaming to `ref` (or removes it from the queue)."
  @spec cancel(GenServer.server(), reference()) :: :ok
  def cancel(server, ref), do: GenServer.cast(server, {:cancel, ref})

  @doc """
  The server's model, once loaded: `{:ok, model}` or `{:error, :noproc | :not_ready | reason}`.

  Reads the registry the server publishes its model in; a process that has not published one
  is asked with the contract's `:get_model` call, whose answer may be the model itself or
  `{:ok, model}` (so processes written to stand in for a `llama_cpp_ex` server answer too).
  """
  @spec fetch_model(GenServer.server()) :: {:ok, Model.t()} | {:error, term()}
  def fetch_model(server) do
    with pid when is_pid(pid) <- GenServer.whereis(server),
         [{_, model}] <- Registry.lookup(LlamaCppEx.Registry, {__MODULE__, pid}) do
      {:ok, model}
    else
      nil -> {:error, :noproc}
      _ -> ask(server, :get_model)
    end
  end

  defp ask(server, message) do
    case GenServer.call(server, message, 5_000) do
      %Model{} = model -> {:ok, model}
      {:ok, %Model{}} = ok -> ok
      {:ok, %Model{} = model, config} -> {:ok, model, config}
      {:error, _} = error -> error
      other -> {:error, {:unexpected_reply, other}}
    end
  catch
    :exit, {:timeout, _} -> {:error, :not_ready}
    :exit, reason -> {:error, exit_reason(reason)}
  end

  # the model and the public config a running server published, else asked of the process;
  # a request is prepared against the model's resources, which live on the server's node
  defp fetch_model_and_config(server) do
    with pid when is_pid(pid) <- GenServer.whereis(server),
         :ok <- local(pid),
         [{_, model}] <- Registry.lookup(LlamaCppEx.Registry, {__MODULE__, pid}),
         [{_, config}] <- Registry.lookup(LlamaCppEx.Registry, {Config, pid}) do
      {:ok, pid, model, config}
    else
      nil ->
        {:error, :noproc}

      {:error, _} = remote ->
        remote

      _ ->
        with {:ok, model, config} <- ask(server, :fetch_model),
             do: {:ok, GenServer.whereis(server), model, config}
    end
  end

  defp local(pid) when node(pid) == node(), do: :ok
  defp local(pid), do: {:error, {:remote_server, node(pid)}}

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
  `queue_depth`, `n_parallel`, `n_batch`, `ram_cache_entries`, `ram_cache_bytes` (and
  `ram_cache_budget_bytes`, `ram_cache_hits`, `ram_cache_saves`, `ram_cache_evictions`),
  `tokens_generated`, `prompt_tokens` and `prefix_cache_tokens` (prompt tokens served from
  cached KV; all since start, finished requests), `kv_free_tokens` (KV the engine reported free
  after the last pass), `requests_completed`, `embed_queue_depth` (texts of
  `embed/3` calls not yet evaluated), `embeddings_completed` (texts), `paused` and
  `pause_level` (see `pause/2`), `paused_ms` (time in a full pause within the window), and
  `window_tokens`, `window_ms`, `tokens_per_second` over the window since start or the last
  `reset_stats_window/1` (time in a full pause left out). With a `:kv_policy`: `kv_precision`
  (of new blocks), `kv_occupancy` (after the last pass), `kv_occupancy_ewma` and
  `kv_precision_changes`.
  """
  @spec get_stats(GenServer.server()) :: map()
  def get_stats(server), do: GenServer.call(server, :get_stats)

  @doc "Restarts the throughput window of `get_stats/1`."
  @spec reset_stats_window(GenServer.server()) :: :ok
  def reset_stats_window(server), do: GenServer.call(server, :reset_stats_window)

  @doc """
  KV audit, answered once the engine is idle: verifies block reference counts and returns
  `%{n_blocks: n, used: [blocks per layer group], owners: [[{seq_id, blocks}]], tokens:
  %{seq_id => positions the cache holds}, cached_tokens: %{seq_id => tokens the server lists}}`.
  """
  @spec kv_audit(GenServer.server(), timeout()) :: {:ok, map()} | {:error, term()}
  def kv_audit(server, timeout \\ 60_000), do: GenServer.call(server, :kv_audit, timeout)

  defp validate_call!(opts, fun) do
    Options.validate!(opts, request_option_keys() ++ @call_keys, "LlamaCppEx.Server.#{fun}")
  end

  defp exit_reason({reason, {GenServer, :call, _}}), do: exit_reason(reason)
  defp exit_reason(r) when r in [:normal, :noproc, :killed, :shutdown], do: :noproc
  defp exit_reason({:shutdown, _}), do: :noproc
  defp exit_reason({:nodedown, _}), do: :noproc
  defp exit_reason(other), do: other

  # ------------------------------------------------------------------ server

  @impl true
  def init(opts) do
    case Config.new(opts) do
      {:ok, config} ->
        cache = PromptCache.new(config.prompt_cache_ram_mb)
        {:ok, %State{config: config, stats: Stats.new(), prompt_cache: cache}, {:continue, :load}}

      {:error, reason} ->
        {:stop, reason}
    end
  end

  @impl true
  def handle_continue(:load, %State{config: cfg} = st) do
    with {:ok, model} <- Model.load(cfg.model_path, cfg.model_opts),
         {:ok, cfg} <- kv_budget(cfg, model),
         {:ok, ctx} <- Context.create(model, cfg.context_opts),
         :ok <- attach_draft(ctx, cfg),
         {:ok, engine} <- NIF.engine_start(ctx.ref) do
      Process.flag(:trap_exit, true)
      {:ok, _} = Registry.register(LlamaCppEx.Registry, {__MODULE__, self()}, model)

      {:ok, _} = Registry.register(LlamaCppEx.Registry, {Config, self()}, Config.public(cfg))

      slots = Map.new(0..(cfg.n_parallel - 1), &{&1, Slot.idle(&1)})
      embed_seqs = Enum.to_list(cfg.n_parallel..(cfg.n_parallel + cfg.embed_parallel - 1))

      st = %{
        st
        | config: cfg,
          model: model,
          ctx: ctx,
          engine: engine,
          slots: slots,
          embed_free: embed_seqs,
          kv_free: cfg.n_ctx,
          kv_policy: cfg.kv_policy,
          swa_window: Model.info(model).swa_window
      }

      # a replica joins its group once it can serve
      {:noreply, if(cfg.cluster == nil, do: st, else: Member.join(st, cfg.cluster))}
    else
      {:error, reason} -> {:stop, {:load_failed, reason}, st}
    end
  end

  # the draft model's context mirrors the target's: its size, sequences, threads, KV types
  defp attach_draft(_ctx, %Config{draft_model: nil}), do: :ok

  # (in one precision: the policy's tiers are the target cache's business)
  defp attach_draft(ctx, %Config{draft_model: draft} = cfg),
    do: Context.attach_draft(ctx, draft, Keyword.delete(cfg.context_opts, :kv_pressure_types))

  # a byte budget becomes n_ctx by the model's bytes per cached token in the chosen types
  defp kv_budget(%Config{kv_budget_mb: nil} = cfg, _model), do: {:ok, cfg}

  defp kv_budget(cfg, model) do
    with {:ok, {type_k, type_v}} <- Context.kv_types(cfg.context_opts),
         {:ok, bytes} <- NIF.kv_bytes_per_token(model.ref, type_k, type_v) do
      {:ok, Config.resolve_budget(cfg, bytes)}
    end
  end

  @impl true
  def handle_call(:fetch_model, _from, %State{model: nil} = st),
    do: {:reply, {:error, :not_ready}, st}

  def handle_call(:fetch_model, _from, st),
    do: {:reply, {:ok, st.model, Config.public(st.config)}, st}

  def handle_call(:get_model, _from, %State{model: nil} = st),
    do: {:reply, {:error, :not_ready}, st}

  def handle_call(:get_model, _from, st), do: {:reply, {:ok, st.model}, st}

  def handle_call(:get_stats, _from, st) do
    waiting = Embeds.texts_waiting(st)
    stats = Stats.snapshot(st.stats, st.slots, :queue.len(st.queue), st.config, waiting)

    stats =
      stats
      |> Map.merge(PromptCache.stats(st.prompt_cache))
      |> Map.merge(KvPolicy.stats(st.kv_policy))
      |> Map.merge(%{
        paused: st.pause_level != :none,
        pause_level: st.pause_level,
        kv_free_tokens: st.kv_free
      })

    {:reply, stats, st}
  end

  def handle_call({:save_prefix, _tokens, _scope}, _from, %State{model: nil} = st),
    do: {:reply, {:error, :not_ready}, st}

  # the copy is taken by the next step (before any op placed after this one) and answered
  # when its outcome comes back
  def handle_call({:save_prefix, tokens, scope}, from, st) do
    n = length(tokens)

    holder =
      Enum.find(st.slots, fn {_, s} ->
        s.cache_scope == scope and Placement.donor_prefix_match(s, tokens) >= n
      end)

    case holder do
      nil ->
        {:reply, {:error, :not_cached}, st}

      {seq, _} ->
        {cache, op} = PromptCache.reply_op(st.prompt_cache, seq, tokens, scope, from)
        st = %{st | prompt_cache: cache, pending_ops: st.pending_ops ++ [op]}
        {:noreply, Tick.schedule(st)}
    end
  end

  def handle_call({:load_prefix, _prefix}, _from, %State{model: nil} = st),
    do: {:reply, {:error, :not_ready}, st}

  def handle_call({:load_prefix, p}, _from, st) do
    with :ok <- NIF.kv_snapshot_check(st.ctx.ref, p.ref),
         {:ok, cache, entry, evicted} <-
           PromptCache.load(st.prompt_cache, p.tokens, p.scope, p.ref, p.bytes) do
      PromptCache.emit(cache, :save, entry.bytes, entry.len)
      Enum.each(evicted, &PromptCache.emit(cache, :evict, &1.bytes, &1.len))
      {:reply, :ok, %{st | prompt_cache: cache}}
    else
      {:error, reason} -> {:reply, {:error, reason}, st}
    end
  end

  # a step is bounded by `n_batch` rows and always ends (or fails), so a full pause waits for
  # the one in flight
  def handle_call({:pause, :full}, from, %State{in_flight: f} = st) when f != nil do
    st = Tick.set_manual_pause(st, :full)
    {:noreply, %{st | pause_waiters: [from | st.pause_waiters]}}
  end

  def handle_call({:pause, level}, _from, st),
    do: {:reply, :ok, st |> Tick.set_manual_pause(level) |> answer_pause_waiters()}

  def handle_call(:reset_stats_window, _from, st),
    do: {:reply, :ok, %{st | stats: Stats.reset_window(st.stats)}}

  def handle_call(:kv_audit, from, st),
    do: {:noreply, answer_audits(%{st | audits: [from | st.audits]})}

  def handle_call({:embed, %EmbedJob{}}, _from, %State{model: nil} = st),
    do: {:reply, {:error, :not_ready}, st}

  def handle_call({:embed, %EmbedJob{} = job}, _from, st) do
    if st.config.max_queue > 0 and map_size(st.embed_jobs) >= st.config.max_queue do
      {:reply, {:error, :queue_full}, st}
    else
      job = %{job | monitor_ref: Process.monitor(job.pid)}

      st = %{
        st
        | embed_jobs: Map.put(st.embed_jobs, job.ref, job),
          embed_order: st.embed_order ++ [job.ref]
      }

      {:reply, :ok, Tick.schedule(st)}
    end
  end

  def handle_call({:cluster, :join, group}, _from, st),
    do: {:reply, :ok, Member.join(st, group)}

  def handle_call({:cluster, :leave, group}, _from, st),
    do: {:reply, :ok, Member.leave(st, group)}

  def handle_call({:subscribe, %Request{} = request}, _from, st) do
    case admit(st, request) do
      {:ok, st} -> {:reply, :ok, st}
      {:error, reason} -> {:reply, {:error, reason}, st}
    end
  end

  defp admit(%State{model: nil}, _request), do: {:error, :not_ready}

  defp admit(st, %Request{} = request) do
    idle = Enum.count(st.slots, fn {_, s} -> s.state == :idle end)
    waiting = :queue.len(st.queue) - idle
    cfg = st.config

    cond do
      cfg.max_queue > 0 and waiting >= cfg.max_queue ->
        {:error, :queue_full}

      true ->
        request = %{request | monitor_ref: Process.monitor(request.stream_pid)}
        {:ok, Tick.schedule(%{st | queue: :queue.in(request, st.queue)})}
    end
  end

  @impl true
  def handle_cast({:cancel, ref}, st), do: {:noreply, st |> Tick.cancel(ref) |> answer_audits()}

  @impl true
  def handle_info(:tick, st), do: {:noreply, st |> Tick.run() |> answer_audits()}

  def handle_info({ref, {:ok, outcome}}, %State{in_flight: %{ref: ref}} = st),
    do: {:noreply, st |> Tick.apply_outcome(outcome) |> answer_audits() |> answer_pause_waiters()}

  def handle_info({ref, {:error, reason}}, %State{in_flight: %{ref: ref}} = st),
    do: {:noreply, st |> Tick.apply_error(reason) |> answer_audits() |> answer_pause_waiters()}

  def handle_info({:DOWN, mref, :process, _pid, _reason}, st),
    do: {:noreply, st |> Tick.consumer_down(mref) |> answer_audits()}

  def handle_info(:cluster_publish, st), do: {:noreply, Member.tick(st)}

  def handle_info({:EXIT, _pid, reason}, st), do: {:stop, reason, st}

  def handle_info(msg, st) do
    Logger.debug("LlamaCppEx.Server ignored #{inspect(msg)}")
    {:noreply, st}
  end

  @impl true
  def terminate(_reason, %State{engine: engine}) when engine != nil do
    NIF.engine_stop(engine)
    :ok
  end

  def terminate(_reason, _state), do: :ok

  # full pauses hold once no step is in flight; a caller whose full pause was lifted or
  # lowered meanwhile is answered too
  defp answer_pause_waiters(%State{pause_waiters: []} = st), do: st

  defp answer_pause_waiters(st) do
    if st.in_flight == nil or st.pause_manual != :full do
      Enum.each(st.pause_waiters, &GenServer.reply(&1, :ok))
      %{st | pause_waiters: []}
    else
      st
    end
  end

  defp answer_audits(%State{audits: []} = st), do: st

  defp answer_audits(st) do
    if st.in_flight == nil and not Tick.has_work?(st) do
      reply =
        with {:ok, usage} <- Context.kv_usage(st.ctx) do
          cached = Map.new(st.slots, fn {seq, s} -> {seq, length(s.cached)} end)
          {:ok, Map.put(usage, :cached_tokens, cached)}
        end

      Enum.each(st.audits, &GenServer.reply(&1, reply))
      %{st | audits: []}
    else
      st
    end
  end
end
