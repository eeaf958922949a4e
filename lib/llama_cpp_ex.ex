defmodule LlamaCppEx do
  @moduledoc """
  Local LLM inference for Elixir on a Rust/candle engine.

  `LlamaCppEx` loads GGUF models, tokenizes with the model's own vocabulary, and generates
  text as a whole or as an Elixir `Stream`, on a model directly or through a
  `LlamaCppEx.Server` that batches many requests.

  ## Quick start

      :ok = LlamaCppEx.init()
      {:ok, model} = LlamaCppEx.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")

      {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", max_tokens: 16, temp: 0.0)

      model
      |> LlamaCppEx.stream("Once upon a time", max_tokens: 64)
      |> Enum.each(&IO.write/1)

  The public API is source-compatible with the `llama_cpp_ex` package (llama.cpp bindings).

  ## How a request runs

  On a model, the calling process drives generation one engine step at a time (a chunk of
  the prompt, then one token): halting a stream, a `:timeout` or the caller's death stops the
  work within one step. Through a server, the request shares the server's forward passes with
  the others and the caller receives its events; giving up on it (halting, timing out,
  dying) frees its slot within one tick. On both routes the same pipeline turns tokens into
  text: UTF-8 characters are never split, stop strings are matched across tokens and never
  emitted, log-probabilities are reported where asked for.

  A prompt longer than the model's training context (or an explicit `:n_ctx`) is an error
  before anything is evaluated.
  """

  alias LlamaCppEx.{
    Chat,
    Completion,
    Context,
    Generation,
    Model,
    NIF,
    Options,
    Sampler,
    Server,
    Source,
    Thinking,
    Tools
  }

  @own_keys [:max_tokens, :n_ctx, :timeout, :grammar, :json_schema, :stop, :speculative]

  @doc false
  # the chat keys too: the contract's generate/3 accepts them (a raw prompt ignores them)
  def generation_option_keys,
    do: @own_keys ++ Chat.option_keys() ++ Sampler.all_keys() ++ Context.tuning_option_keys()

  @server_chat_keys [
    :max_tokens,
    :timeout,
    :add_assistant,
    :chat_template_kwargs,
    :enable_thinking,
    :json_schema
  ]

  @doc "Initialises the backend. Idempotent."
  @spec init() :: :ok
  def init, do: :ok

  @doc """
  The devices the engine can run on: the GPUs of a CUDA build (`LLAMA_BACKEND=cuda`), as
  llama.cpp names them, then the CPU. A CPU build, or a machine without a GPU, lists the CPU
  only:

      [%{index: 0, gpu_index: nil, name: "CPU", type: :cpu, backend: "CPU", ...}]

  A GPU entry reads `%{index: 0, gpu_index: 0, name: "CUDA0", description: "NVIDIA H200",
  type: :gpu, backend: "CUDA", memory_total: …, memory_free: …}`.
  """
  @spec devices() :: [map()]
  def devices do
    {total, free} = memory_info()

    gpus =
      for g <- NIF.gpu_devices() do
        %{
          index: g.index,
          gpu_index: g.index,
          name: "CUDA#{g.index}",
          description: g.name,
          type: :gpu,
          backend: "CUDA",
          memory_total: g.memory_total,
          memory_free: g.memory_free
        }
      end

    gpus ++
      [
        %{
          index: length(gpus),
          gpu_index: nil,
          name: "CPU",
          description: cpu_description(),
          type: :cpu,
          backend: "CPU",
          memory_total: total,
          memory_free: free
        }
      ]
  end

  defp memory_info do
    with {:ok, text} <- File.read("/proc/meminfo"),
         [_, total] <- Regex.run(~r/MemTotal:\s+(\d+) kB/, text),
         [_, free] <- Regex.run(~r/MemAvailable:\s+(\d+) kB/, text) do
      {String.to_integer(total) * 1024, String.to_integer(free) * 1024}
    else
      _ -> {0, 0}
    end
  end

  defp cpu_description do
    with {:ok, text} <- File.read("/proc/cpuinfo"),
         [_, name] <- Regex.run(~r/model name\s*:\s*(.+)/, text) do
      String.trim(name)
    else
      _ -> to_string(:erlang.system_info(:system_architecture))
    end
  end

  @doc "Loads a GGUF model; see `LlamaCppEx.Model.load/2`."
  @spec load_model(Path.t(), keyword()) :: {:ok, Model.t()} | {:error, String.t()}
  def load_model(path, opts \\ []), do: Model.load(path, opts)

  @doc """
  Downloads `filename` from the Hugging Face repository `repo_id` (cached, SHA-256 verified;
  see `LlamaCppEx.Hub.download/3`) and loads it with `load_model/2`.

  The options of `LlamaCppEx.Hub.download/3` (`:cache_dir`, `:token`, `:progress`,
  `:revision`, `:force`, `:verify_checksum`, `:endpoint`, `:proxy`, `:no_proxy`,
  `:http_client`) go to the download, the rest to `load_model/2`.

      {:ok, model} =
        LlamaCppEx.load_model_from_hub("bartowski/SmolLM2-135M-Instruct-GGUF",
          "SmolLM2-135M-Instruct-Q4_K_M.gguf", progress: true)
  """
  @spec load_model_from_hub(String.t(), String.t(), keyword()) ::
          {:ok, Model.t()} | {:error, String.t()}
  def load_model_from_hub(repo_id, filename, opts \\ []) do
    {hub_opts, model_opts} = Keyword.split(opts, LlamaCppEx.Hub.download_option_keys())
    Options.validate!(model_opts, Model.option_keys(), "LlamaCppEx.load_model_from_hub/3")

    with {:ok, path} <- LlamaCppEx.Hub.download(repo_id, filename, hub_opts) do
      load_model(path, model_opts)
    end
  end

  @doc "The embedding of `text`; see `LlamaCppEx.Embedding.embed/3`."
  @spec embed(Model.t(), String.t(), keyword()) ::
          {:ok, LlamaCppEx.Embedding.t() | [LlamaCppEx.Embedding.t()]} | {:error, String.t()}
  def embed(%Model{} = model, text, opts \\ []), do: LlamaCppEx.Embedding.embed(model, text, opts)

  @doc "The embeddings of `texts` in one pass; see `LlamaCppEx.Embedding.embed_batch/3`."
  @spec embed_batch(Model.t(), [String.t()], keyword()) :: {:ok, list()} | {:error, String.t()}
  def embed_batch(%Model{} = model, texts, opts \\ []),
    do: LlamaCppEx.Embedding.embed_batch(model, texts, opts)

  @doc "Relevance scores of `documents` for `query`; see `LlamaCppEx.Embedding.rerank/4`."
  @spec rerank(Model.t(), String.t(), [String.t()], keyword()) ::
          {:ok, [float()]} | {:error, String.t()}
  def rerank(%Model{} = model, query, documents, opts \\ []),
    do: LlamaCppEx.Embedding.rerank(model, query, documents, opts)

  @doc """
  Generates text for `prompt`.

  ## Options

    * `:max_tokens` - at most this many new tokens. Default 256.
    * `:n_ctx` - minimum context size. Default 2048. The context holds
      `max(n_ctx, prompt tokens + max_tokens)` tokens, at most the model's training context
      unless `:n_ctx` itself is larger.
    * `:stop` - a string or a list of strings; generation ends at the first (not included).
    * `:grammar` / `:json_schema` - constrain the output; see `LlamaCppEx.Grammar`.
    * sampler options (`:temp`, `:top_k`, `:top_p`, `:min_p`, `:seed`, penalties, ...), see
      `LlamaCppEx.Sampler.create/2`.
    * context tuning options such as `:n_threads`, see `LlamaCppEx.Context.create/2`.
    * `:timeout` - the longest one step may take, in ms (default 60_000); past it the result
      is `{:error, :timeout}`.
    * `:speculative` - `[mode: :prompt_lookup, n_draft: 8]` drafts tokens from the prompt and
      the output so far and verifies them in one pass; `[mode: :draft, draft_model: m,
      n_draft: 4]` drafts with a smaller model sharing the vocabulary (a `LlamaCppEx.Model`
      or a GGUF path, loaded per call). Either way the text is the same as without it
      (lossless for every sampler). Off by default.
    * `:add_assistant`, `:enable_thinking`, `:chat_template_kwargs` - accepted as
      `llama_cpp_ex` accepts them, and without effect: they shape a chat template, and a raw
      prompt has none (see `chat/3`).

  ## Example

      {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", max_tokens: 8, temp: 0.0)
  """
  @spec generate(Model.t(), String.t(), keyword()) :: {:ok, String.t()} | {:error, term()}
  def generate(%Model{} = model, prompt, opts \\ []) do
    Options.validate!(opts, generation_option_keys(), "LlamaCppEx.generate/3")
    opts = Generation.options!(opts, :model)

    with {:ok, src} <- open_model(model, prompt, opts, Options.timeout(opts, :blocking)),
         {:ok, %{text: text}} <- Source.collect(src) do
      {:ok, text}
    end
  end

  # a prepared request on a private context of `model`
  defp open_model(model, prompt, opts, timeout) do
    with {:ok, gen} <- Generation.prepare(model, prompt, opts, :model) do
      Source.stepper(gen, Keyword.take(opts, [:n_ctx | Context.tuning_option_keys()]), timeout)
    end
  end

  @doc """
  Streams generated text as binary chunks.

  Chunks never split a UTF-8 codepoint. A setup failure yields a single `{:error, reason}`
  element; a generation error ends the stream with `{:error, reason}`; a step taking more
  than `:timeout` ms (default 30_000) ends it with `{:error, :timeout}`. Halting the stream
  early (e.g. `Enum.take/2`) stops generation at once.

  Options are those of `generate/3`.

  ## Example

      model |> LlamaCppEx.stream("Once upon a time", max_tokens: 32) |> Enum.join()
  """
  @spec stream(Model.t(), String.t(), keyword()) :: Enumerable.t()
  def stream(%Model{} = model, prompt, opts \\ []) do
    Options.validate!(opts, generation_option_keys(), "LlamaCppEx.stream/3")
    opts = Generation.options!(opts, :model)
    text_stream(fn -> open_model(model, prompt, opts, Options.timeout(opts, :stream)) end)
  end

  @doc false
  # The binaries of a request's `{:token, text}` events, then `{:error, reason}` if it failed.
  @spec text_stream((() -> {:ok, Source.t()} | {:error, term()})) :: Enumerable.t()
  def text_stream(open) do
    Stream.resource(
      fn ->
        case open.() do
          {:ok, src} -> {:open, src}
          {:error, reason} -> {:failed, reason}
        end
      end,
      fn
        {:failed, reason} ->
          {[{:error, reason}], :closed}

        :closed ->
          {:halt, :closed}

        {:open, src} ->
          {status, events, src} = Source.next(src)

          elements =
            Enum.flat_map(events, fn
              {:token, t} -> [t]
              {:error, reason} -> [{:error, reason}]
              _ -> []
            end)

          if status == :done,
            do: {elements, {:finished, src}},
            else: {elements, {:open, src}}

        {:finished, src} ->
          {:halt, {:finished, src}}
      end,
      fn
        {:open, src} -> Source.close(src)
        {:finished, src} -> Source.close(src)
        _ -> :ok
      end
    )
  end

  @doc """
  Applies the model's chat template to `messages` and generates a reply; see
  `LlamaCppEx.Chat.apply_template/3` for messages and `generate/3` for options.
  """
  @spec chat(Model.t(), [Chat.message()], keyword()) :: {:ok, String.t()} | {:error, term()}
  def chat(%Model{} = model, messages, opts \\ []) do
    Options.validate!(opts, chat_option_keys(), "LlamaCppEx.chat/3")
    gen_opts = Generation.options!(Keyword.drop(opts, chat_only_keys()), :model)

    with {:ok, prompt, extra, _tools} <- render_chat(model, messages, opts),
         {:ok, src} <-
           open_model(model, prompt, extra ++ gen_opts, Options.timeout(opts, :blocking)),
         {:ok, %{text: text}} <- Source.collect(src) do
      {:ok, text}
    end
  end

  @doc "Like `chat/3`, streaming text chunks as `stream/3` does."
  @spec stream_chat(Model.t(), [Chat.message()], keyword()) :: Enumerable.t()
  def stream_chat(%Model{} = model, messages, opts \\ []) do
    Options.validate!(opts, chat_option_keys(), "LlamaCppEx.stream_chat/3")
    gen_opts = Generation.options!(Keyword.drop(opts, chat_only_keys()), :model)

    text_stream(fn ->
      with {:ok, prompt, extra, _tools} <- render_chat(model, messages, opts) do
        open_model(model, prompt, extra ++ gen_opts, Options.timeout(opts, :stream))
      end
    end)
  end

  # The keys of the chat routes on a model: generation's, and the tools'.
  defp chat_option_keys, do: generation_option_keys() ++ Tools.option_keys()
  # The keys that shape the prompt (or parse the answer), not the generation.
  defp chat_only_keys, do: [:include_usage | Chat.option_keys() ++ Tools.option_keys()]

  # The chat prompt of `messages` (tools rendered) with the options tools add to the request
  # (their constraint): `{:ok, prompt, extra_opts, tools | nil}`.
  defp render_chat(model, messages, opts) do
    with {:ok, tools} <- Tools.prepare(model, opts),
         {:ok, prompt, extra} <- render_with(model, messages, opts, tools) do
      {:ok, prompt, extra, tools}
    end
  end

  # ... with the tools already prepared: `{:ok, prompt, extra_opts}`
  defp render_with(model, messages, opts, tools) do
    {messages, chat_opts} =
      Tools.render_input(tools, messages, Keyword.take(opts, Chat.option_keys()))

    with {:ok, prompt} <- Chat.apply_template(model, messages, chat_opts) do
      {:ok, prompt, Tools.request_options(tools)}
    end
  end

  @doc """
  An OpenAI-shaped chat completion (`%LlamaCppEx.ChatCompletion{}`) from a model or from a
  `LlamaCppEx.Server` (pid or name).

  `:timeout` (default 60_000 ms) bounds the wait for each piece of the reply; past it the
  result is `{:error, :timeout}` and, on a server, the request is cancelled. On a server,
  per-request server options (`:session`, `:cache_scope`, sampler keys) apply.
  `:enable_thinking` (default `false` here) splits `<think>` blocks into `reasoning_content`;
  `:logprobs` / `:top_logprobs` add OpenAI-shaped log-probabilities to the choice.
  """
  @spec chat_completion(Model.t() | GenServer.server(), [Chat.message()], keyword()) ::
          {:ok, LlamaCppEx.ChatCompletion.t()} | {:error, term()}
  def chat_completion(model_or_server, messages, opts \\ []) do
    server? = not match?(%Model{}, model_or_server)
    Options.validate!(opts, chat_keys(server?), "LlamaCppEx.chat_completion/3")
    opts = Keyword.put_new(opts, :enable_thinking, false)
    timeout = Options.timeout(opts, :blocking)

    with {:ok, src, gen, tools} <-
           open_chat(model_or_server, server?, messages, opts, timeout, :generate),
         {:ok, result} <- Source.collect(src) do
      {:ok, Completion.completion(gen, result, opts, tools)}
    end
  end

  @doc """
  Streams `%LlamaCppEx.ChatCompletionChunk{}`s from a model or a server: a role chunk, one
  chunk per text piece (`delta: %{content: piece}`, or `%{reasoning_content: piece}` inside a
  `<think>` block with `enable_thinking: true`), and a final chunk with `finish_reason`;
  with `include_usage: true` (default false) a last chunk with no choices carries `usage`. Setup
  failures and errors are a single `{:error, reason}` element; `:timeout` (default 30_000 ms)
  bounds the wait for each chunk. Halting the stream or timing out cancels a server request.
  """
  @spec stream_chat_completion(Model.t() | GenServer.server(), [Chat.message()], keyword()) ::
          Enumerable.t()
  def stream_chat_completion(model_or_server, messages, opts \\ []) do
    server? = not match?(%Model{}, model_or_server)

    Options.validate!(
      opts,
      [:include_usage | chat_keys(server?)],
      "LlamaCppEx.stream_chat_completion/3"
    )

    opts = Keyword.put_new(opts, :enable_thinking, false)
    timeout = Options.timeout(opts, :stream)
    # what must raise raises now, not when the stream is consumed
    _ = Generation.options!(Keyword.drop(opts, chat_only_keys()), route_of(server?))

    Stream.resource(
      fn ->
        case open_chat(model_or_server, server?, messages, opts, timeout, :stream) do
          {:ok, src, gen, tools} ->
            %{
              src: src,
              base: Completion.chunk_base(gen.model),
              parser: if(opts[:enable_thinking], do: Thinking.stream_parser(thinking: true)),
              calls: Completion.calls_stream(tools),
              usage: if(opts[:include_usage], do: %{prompt_tokens: length(gen.tokens)}),
              logprobs?: gen.logprobs,
              lps: [],
              phase: :role
            }

          {:error, reason} ->
            {:failed, reason}
        end
      end,
      &next_chat_chunk/1,
      fn
        %{src: src} -> Source.close(src)
        _ -> :ok
      end
    )
  end

  defp chat_keys(true),
    do: @server_chat_keys ++ Tools.option_keys() ++ Server.request_option_keys()

  defp chat_keys(false), do: chat_option_keys()

  defp route_of(true), do: :server
  defp route_of(false), do: :model

  # The chat's request, prepared and opened on its route: `{:ok, source, generation}`.
  # `mode` is the server's telemetry's, as the contract's routes report it (a blocking call
  # `:generate`, a stream `:stream`).
  defp open_chat(target, server?, messages, opts, timeout, mode) do
    gen_opts =
      Generation.options!(
        opts |> Keyword.drop(chat_only_keys()) |> Keyword.delete(:timeout),
        route_of(server?)
      )

    if server? do
      # tools are prepared once, against the server's model, before the request is admitted
      with {:ok, model} <- Server.fetch_model(target),
           {:ok, tools} <- Tools.prepare(model, opts),
           render = &render_with(&1, messages, opts, tools),
           {:ok, src, gen} <- Server.open(target, render, gen_opts, mode, timeout) do
        {:ok, src, gen, tools}
      end
    else
      with {:ok, prompt, extra, tools} <- render_chat(target, messages, opts),
           {:ok, gen} <- Generation.prepare(target, prompt, extra ++ gen_opts, :model),
           {:ok, src} <-
             Source.stepper(
               gen,
               Keyword.take(opts, [:n_ctx | Context.tuning_option_keys()]),
               timeout
             ) do
        {:ok, src, gen, tools}
      end
    end
  end

  # `include_usage: true`: after the last chunk, one with `usage` and no choices (OpenAI's
  # `stream_options.include_usage`)
  defp with_usage_chunk(
         {chunks, %{usage: %{completion_tokens: n, prompt_tokens: p}} = st},
         :done
       ),
       do:
         {chunks ++
            [
              %{
                st.base
                | choices: [],
                  usage: %{prompt_tokens: p, completion_tokens: n, total_tokens: p + n}
              }
            ], st}

  defp with_usage_chunk(result, _status), do: result

  defp next_chat_chunk({:failed, reason}), do: {[{:error, reason}], :closed}
  defp next_chat_chunk(:closed), do: {:halt, :closed}
  defp next_chat_chunk(%{phase: :done} = st), do: {:halt, st}

  defp next_chat_chunk(%{phase: :role} = st) do
    {[Completion.chunk(st.base, %{role: "assistant", content: ""}, nil)],
     %{st | phase: :streaming}}
  end

  defp next_chat_chunk(%{phase: :streaming} = st) do
    {status, events, src} = Source.next(st.src)
    st = %{st | src: src}

    {chunks, st} =
      Enum.reduce(events, {[], st}, fn
        {:token, text}, {acc, st} ->
          {deltas, st} = route(st, text)
          {chunks, st} = delta_chunks(st, deltas)
          {acc ++ chunks, st}

        {:logprob, lp}, {acc, st} ->
          {acc, %{st | lps: [lp | st.lps]}}

        {:done, reason}, {acc, st} ->
          {deltas, calls} = Completion.finish_calls(st.calls)
          {chunks, st} = delta_chunks(%{st | calls: calls}, deltas)
          finish = Completion.finish_reason(reason, Completion.called?(calls))
          {acc ++ chunks ++ [Completion.chunk(st.base, %{}, finish)], st}

        {:error, reason}, {acc, st} ->
          {acc ++ [{:error, reason}], st}

        {:usage, %{completion_tokens: n}}, {acc, %{usage: %{} = u} = st} ->
          {acc, %{st | usage: Map.put(u, :completion_tokens, n)}}

        _, acc_st ->
          acc_st
      end)

    {chunks, if(status == :done, do: %{st | phase: :done}, else: st)}
    |> with_usage_chunk(status)
  end

  # Content chunks; the log-probabilities of the tokens behind them ride on the first one.
  defp delta_chunks(st, []), do: {[], st}

  defp delta_chunks(st, deltas) do
    [first | rest] = Enum.map(deltas, &Completion.chunk(st.base, &1, nil))

    if st.logprobs? and st.lps != [] do
      {[Completion.with_logprobs(first, Enum.reverse(st.lps)) | rest], %{st | lps: []}}
    else
      {[first | rest], st}
    end
  end

  defp route(%{parser: nil} = st, text), do: content_deltas(st, text)

  defp route(st, text) do
    {events, parser} = Thinking.feed(st.parser, text)

    Enum.reduce(events, {[], %{st | parser: parser}}, fn
      {:thinking, t}, {acc, st} ->
        {acc ++ [%{reasoning_content: t}], st}

      {:content, t}, {acc, st} ->
        {deltas, st} = content_deltas(st, t)
        {acc ++ deltas, st}
    end)
  end

  # content, through the tool-call parser when the request has tools
  defp content_deltas(st, text) do
    {deltas, calls} = Completion.feed_calls(st.calls, text)
    {deltas, %{st | calls: calls}}
  end
end
