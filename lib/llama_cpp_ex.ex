defmodule LlamaCppEx do
  @moduledoc """
  Local LLM inference for Elixir on a Rust/candle engine.

  `LlamaCppEx` loads GGUF models (llama and Gemma 3 families), tokenizes with the model's own
  vocabulary, and generates text as a whole or as an Elixir `Stream`.

  ## Quick start

      :ok = LlamaCppEx.init()
      {:ok, model} = LlamaCppEx.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")

      {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", max_tokens: 16, temp: 0.0)

      model
      |> LlamaCppEx.stream("Once upon a time", max_tokens: 64)
      |> Enum.each(&IO.write/1)

  The public API is source-compatible with the `llama_cpp_ex` package (llama.cpp bindings).
  """

  alias LlamaCppEx.{
    Chat,
    ChatCompletion,
    ChatCompletionChunk,
    Context,
    Generator,
    Model,
    NIF,
    Options,
    Grammar,
    Sampler,
    Server,
    StopMatcher,
    Thinking,
    Tokenizer,
    UTF8Stream
  }

  @own_keys [:max_tokens, :n_ctx, :timeout, :grammar, :json_schema, :stop]

  @doc false
  def generation_option_keys,
    do:
      @own_keys ++
        Sampler.option_keys() ++
        Sampler.logprob_keys() ++ Sampler.extra_keys() ++ Context.tuning_option_keys()

  @doc "Initialises the backend. Idempotent."
  @spec init() :: :ok
  def init, do: NIF.backend_init()

  @doc """
  The devices the engine can run on. This build computes on the CPU:

      [%{index: 0, gpu_index: nil, name: "CPU", type: :cpu, backend: "CPU", ...}]
  """
  @spec devices() :: [map()]
  def devices do
    :ok = init()
    {total, free} = memory_info()

    [
      %{
        index: 0,
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
  Generates text for `prompt`.

  A fresh context (of `max(n_ctx, prompt tokens + max_tokens)` tokens) and sampler are created
  per call.

  ## Options

    * `:max_tokens` - at most this many new tokens. Default 256.
    * `:n_ctx` - minimum context size. Default 2048.
    * sampler options (`:temp`, `:top_k`, `:top_p`, `:min_p`, `:seed`, penalties), see
      `LlamaCppEx.Sampler.create/2`.
    * context tuning options such as `:n_threads`, see `LlamaCppEx.Context.create/2`.
    * `:timeout` - accepted; a blocking generate runs to completion.

  ## Example

      {:ok, text} = LlamaCppEx.generate(model, "The capital of France is", max_tokens: 8, temp: 0.0)
  """
  @spec generate(Model.t(), String.t(), keyword()) :: {:ok, String.t()} | {:error, term()}
  def generate(%Model{} = model, prompt, opts \\ []) do
    Options.validate!(opts, generation_option_keys(), "LlamaCppEx.generate/3")
    opts = resolve_grammar_opts!(opts)

    if StopMatcher.new(opts[:stop]) do
      generate_via_stream(model, prompt, opts)
    else
      generate_direct(model, prompt, opts)
    end
  end

  defp generate_via_stream(model, prompt, opts) do
    model
    |> stream(prompt, Keyword.put_new(opts, :timeout, :infinity))
    |> Enum.reduce_while({:ok, []}, fn
      {:error, reason}, _ -> {:halt, {:error, reason}}
      chunk, {:ok, acc} -> {:cont, {:ok, [acc, chunk]}}
    end)
    |> case do
      {:ok, iodata} -> {:ok, IO.iodata_to_binary(iodata)}
      error -> error
    end
  end

  defp generate_direct(model, prompt, opts) do
    with {:ok, max_tokens} <- max_tokens(opts),
         {:ok, tokens} <- prompt_tokens(model, prompt),
         {:ok, ctx, sampler} <- setup(model, tokens, max_tokens, opts) do
      Context.generate(ctx, sampler, tokens, max_tokens: max_tokens)
    end
  end

  @doc """
  Streams generated text as binary chunks.

  Chunks never split a UTF-8 codepoint. A setup failure yields a single `{:error, reason}`
  element; a generation error ends the stream with `{:error, reason}`; waiting more than
  `:timeout` ms (default 30_000) for a chunk ends it with `{:error, :timeout}`. Halting the
  stream early (e.g. `Enum.take/2`) stops the native generator within one token.

  Options are those of `generate/3`.

  ## Example

      model |> LlamaCppEx.stream("Once upon a time", max_tokens: 32) |> Enum.join()
  """
  @spec stream(Model.t(), String.t(), keyword()) :: Enumerable.t()
  def stream(%Model{} = model, prompt, opts \\ []) do
    Options.validate!(opts, generation_option_keys(), "LlamaCppEx.stream/3")
    opts = resolve_grammar_opts!(opts)
    timeout = Options.timeout(opts, :stream)

    Stream.resource(
      fn -> start_stream(model, prompt, opts, timeout) end,
      &next_chunk/1,
      &stop_stream/1
    )
  end

  defp start_stream(model, prompt, opts, timeout) do
    with {:ok, max_tokens} <- max_tokens(opts),
         {:ok, tokens} <- prompt_tokens(model, prompt),
         {:ok, ctx, sampler} <- setup(model, tokens, max_tokens, opts) do
      {:ok, gen} =
        Generator.start(fn {caller, ref, cancel} ->
          NIF.generate_tokens(ctx.ref, sampler.ref, tokens, max_tokens, caller, ref, cancel)
        end)

      {:running, gen, "", timeout, StopMatcher.new(opts[:stop])}
    else
      {:error, reason} -> {:failed, reason}
    end
  end

  defp next_chunk({:failed, reason}), do: {[{:error, reason}], :finished}
  defp next_chunk(:finished), do: {:halt, :finished}

  defp next_chunk({:running, %{ref: ref} = gen, pending, timeout, matcher}) do
    receive do
      {^ref, {:token, _id, piece} = msg} ->
        _ = msg
        {emit, pending} = UTF8Stream.push(pending, piece)

        case stop_push(matcher, emit) do
          {:cont, "", matcher} -> next_chunk({:running, gen, pending, timeout, matcher})
          {:cont, emit, matcher} -> {[emit], {:running, gen, pending, timeout, matcher}}
          {:stop, emit} -> {flush(emit), {:done, gen}}
        end

      {^ref, done} when done in [:eog, :done] ->
        {flush(stop_flush(matcher) <> pending), {:done, gen}}

      {^ref, {:error, reason}} ->
        {flush(stop_flush(matcher) <> pending) ++ [{:error, reason}], {:done, gen}}
    after
      timeout -> {[{:error, :timeout}], {:done, gen}}
    end
  end

  defp next_chunk({:done, _gen} = state), do: {:halt, state}

  defp stop_push(nil, text), do: {:cont, text, nil}
  defp stop_push(matcher, text), do: StopMatcher.push(matcher, text)

  defp stop_flush(nil), do: ""
  defp stop_flush(matcher), do: StopMatcher.flush(matcher)

  defp flush(""), do: []
  defp flush(pending), do: [pending]

  defp stop_stream({:running, gen, _, _, _}), do: Generator.stop(gen)
  defp stop_stream({:done, gen}), do: Generator.stop(gen)
  defp stop_stream(_), do: :ok

  @doc """
  Applies the model's chat template to `messages` and generates a reply; see
  `LlamaCppEx.Chat.apply_template/3` for messages and `generate/3` for options.
  """
  @spec chat(Model.t(), [Chat.message()], keyword()) :: {:ok, String.t()} | {:error, term()}
  def chat(%Model{} = model, messages, opts \\ []) do
    Options.validate!(opts, generation_option_keys() ++ Chat.option_keys(), "LlamaCppEx.chat/3")
    {chat_opts, gen_opts} = Keyword.split(opts, Chat.option_keys())

    with {:ok, prompt} <- Chat.apply_template(model, messages, chat_opts) do
      generate(model, prompt, gen_opts)
    end
  end

  @doc "Like `chat/3`, streaming text chunks as `stream/3` does."
  @spec stream_chat(Model.t(), [Chat.message()], keyword()) :: Enumerable.t()
  def stream_chat(%Model{} = model, messages, opts \\ []) do
    Options.validate!(
      opts,
      generation_option_keys() ++ Chat.option_keys(),
      "LlamaCppEx.stream_chat/3"
    )

    {chat_opts, gen_opts} = Keyword.split(opts, Chat.option_keys())

    case Chat.apply_template(model, messages, chat_opts) do
      {:ok, prompt} -> stream(model, prompt, gen_opts)
      {:error, reason} -> [{:error, reason}]
    end
  end

  @server_chat_keys [
    :max_tokens,
    :timeout,
    :add_assistant,
    :chat_template_kwargs,
    :enable_thinking,
    :json_schema
  ]

  @doc """
  An OpenAI-shaped chat completion (`%LlamaCppEx.ChatCompletion{}`) from a model or from a
  `LlamaCppEx.Server` (pid or name).

  On a model, tokens are collected from a linked generator with a per-token wait of
  `:timeout` (default 60_000 ms; `{:error, :timeout}` past it). On a server, the request goes
  through `LlamaCppEx.Server.complete_tokens/3` and `:timeout` bounds the call; per-request
  server options (`:session`, `:cache_scope`, sampler keys) apply. `:enable_thinking`
  (default `false` here) splits `<think>` blocks into `reasoning_content`.
  """
  @spec chat_completion(Model.t() | GenServer.server(), [Chat.message()], keyword()) ::
          {:ok, ChatCompletion.t()} | {:error, term()}
  def chat_completion(model_or_server, messages, opts \\ [])

  def chat_completion(%Model{} = model, messages, opts) do
    Options.validate!(
      opts,
      generation_option_keys() ++ Chat.option_keys(),
      "LlamaCppEx.chat_completion/3"
    )

    opts = resolve_grammar_opts!(opts)
    opts = Keyword.put_new(opts, :enable_thinking, false)
    {chat_opts, gen_opts} = Keyword.split(opts, Chat.option_keys())
    timeout = Options.timeout(opts, :blocking)

    with {:ok, prompt} <- Chat.apply_template(model, messages, chat_opts),
         {:ok, max_tokens} <- max_tokens(gen_opts),
         {:ok, tokens} <- prompt_tokens(model, prompt),
         {:ok, ctx, sampler} <- setup(model, tokens, max_tokens, gen_opts) do
      {:ok, gen} =
        Generator.start(fn {caller, ref, cancel} ->
          NIF.generate_tokens(ctx.ref, sampler.ref, tokens, max_tokens, caller, ref, cancel)
        end)

      result = collect(gen, timeout, {[], "", StopMatcher.new(opts[:stop]), []}, 0)
      Generator.stop(gen)

      with {:ok, text, n, reason, lps} <- result do
        {:ok, completion(model, text, length(tokens), n, reason, opts, lps)}
      end
    end
  end

  def chat_completion(server, messages, opts) do
    Options.validate!(
      opts,
      @server_chat_keys ++ Server.request_option_keys(),
      "LlamaCppEx.chat_completion/3"
    )

    opts = resolve_grammar_opts!(opts)
    opts = Keyword.put_new(opts, :enable_thinking, false)
    {chat_opts, req_opts} = Keyword.split(opts, Chat.option_keys())

    with {:ok, model} <- Server.fetch_model(server),
         {:ok, prompt} <- Chat.apply_template(model, messages, chat_opts),
         {:ok, tokens} <- prompt_tokens(model, prompt),
         {:ok, %{text: text, completion_tokens: n, finish_reason: reason} = reply} <-
           server_complete(server, tokens, Keyword.delete(req_opts, :json_schema)) do
      lps = if is_map(reply), do: Map.get(reply, :logprobs, []), else: []
      {:ok, completion(model, text, length(tokens), n, reason, opts, lps)}
    end
  end

  defp server_complete(server, tokens, opts) do
    Server.complete_tokens(server, tokens, opts)
  catch
    :exit, {:timeout, _} ->
      {:error, :timeout}

    :exit, _ ->
      {:error, :noproc}
  end

  defp collect(%{ref: ref} = gen, timeout, {acc, pending, matcher, lps}, n) do
    receive do
      {^ref, {:token, _id, piece}} ->
        collect_piece(gen, timeout, {acc, pending, matcher, lps}, n, piece)

      {^ref, {:token, _id, piece, lp}} ->
        collect_piece(gen, timeout, {acc, pending, matcher, [{piece, lp} | lps]}, n, piece)

      {^ref, done} when done in [:eog, :done] ->
        text = IO.iodata_to_binary([acc, stop_flush(matcher), pending])
        {:ok, text, n, if(done == :eog, do: :eog, else: :max_tokens), Enum.reverse(lps)}

      {^ref, {:error, reason}} ->
        {:error, reason}
    after
      timeout -> {:error, :timeout}
    end
  end

  defp collect_piece(gen, timeout, {acc, pending, matcher, lps}, n, piece) do
    {emit, pending} = UTF8Stream.push(pending, piece)

    case stop_push(matcher, emit) do
      {:cont, emit, matcher} ->
        collect(gen, timeout, {[acc, emit], pending, matcher, lps}, n + 1)

      {:stop, emit} ->
        {:ok, IO.iodata_to_binary([acc, emit]), n + 1, :stop, Enum.reverse(lps)}
    end
  end

  defp completion(model, text, n_prompt, n, reason, opts, lps) do
    {reasoning, content} = if opts[:enable_thinking], do: Thinking.parse(text), else: {"", text}

    choice = %{
      index: 0,
      message: %{
        role: "assistant",
        content: content,
        reasoning_content: if(reasoning == "", do: nil, else: reasoning)
      },
      finish_reason: finish_reason(reason)
    }

    choice =
      if opts[:logprobs] == true or (opts[:top_logprobs] || 0) > 0,
        do: Map.put(choice, :logprobs, %{content: Enum.map(lps, &openai_logprob/1)}),
        else: choice

    %ChatCompletion{
      id: completion_id(),
      object: "chat.completion",
      created: System.os_time(:second),
      model: Model.desc(model),
      choices: [choice],
      usage: %{prompt_tokens: n_prompt, completion_tokens: n, total_tokens: n_prompt + n}
    }
  end

  defp openai_logprob({piece, {lp, top}}) do
    %{
      token: printable(piece),
      logprob: lp,
      bytes: :binary.bin_to_list(piece),
      top_logprobs:
        Enum.map(top, fn {_id, p, l} ->
          %{token: printable(p), logprob: l, bytes: :binary.bin_to_list(p)}
        end)
    }
  end

  # A token's text; bytes that are not valid UTF-8 on their own (a codepoint split across
  # tokens) become U+FFFD, as OpenAI's API does; `bytes` keeps them exact.
  defp printable(piece) do
    case :unicode.characters_to_binary(piece) do
      s when is_binary(s) -> s
      {_, good, rest} -> good <> "\uFFFD" <> printable(binary_part(rest, 1, byte_size(rest) - 1))
    end
  end

  defp finish_reason(reason) when reason in [:eog, :stop], do: "stop"
  defp finish_reason(_), do: "length"

  defp completion_id,
    do: "chatcmpl-" <> Base.encode16(:crypto.strong_rand_bytes(12), case: :lower)

  @doc """
  Streams `%LlamaCppEx.ChatCompletionChunk{}`s from a model or a server: a role chunk, one
  chunk per text piece (`delta: %{content: piece}`, or `%{reasoning_content: piece}` inside a
  `<think>` block with `enable_thinking: true`), and a final chunk with `finish_reason`. Setup
  failures and errors are a single `{:error, reason}` element; `:timeout` (default 30_000 ms)
  bounds the wait for each chunk.
  """
  @spec stream_chat_completion(Model.t() | GenServer.server(), [Chat.message()], keyword()) ::
          Enumerable.t()
  def stream_chat_completion(model_or_server, messages, opts \\ []) do
    server? = not match?(%Model{}, model_or_server)

    keys =
      if server?,
        do: @server_chat_keys ++ Server.request_option_keys(),
        else: generation_option_keys() ++ Chat.option_keys()

    Options.validate!(opts, keys, "LlamaCppEx.stream_chat_completion/3")
    opts = resolve_grammar_opts!(opts)
    opts = Keyword.put_new(opts, :enable_thinking, false)
    timeout = Options.timeout(opts, :stream)

    Stream.resource(
      fn -> start_chat_stream(model_or_server, server?, messages, opts, timeout) end,
      &next_chat_chunk/1,
      &stop_chat_stream/1
    )
  end

  defp start_chat_stream(target, server?, messages, opts, timeout) do
    {chat_opts, rest} = Keyword.split(opts, Chat.option_keys())

    with {:ok, model} <- if(server?, do: Server.fetch_model(target), else: {:ok, target}),
         {:ok, prompt} <- Chat.apply_template(model, messages, chat_opts),
         {:ok, tokens} <- prompt_tokens(model, prompt),
         {:ok, source} <- start_source(target, server?, model, tokens, rest) do
      base = %ChatCompletionChunk{
        id: completion_id(),
        object: "chat.completion.chunk",
        created: System.os_time(:second),
        model: Model.desc(model)
      }

      parser = if opts[:enable_thinking], do: Thinking.stream_parser(thinking: true)

      %{
        source: source,
        base: base,
        parser: parser,
        pending: "",
        timeout: timeout,
        phase: :role,
        matcher: StopMatcher.new(opts[:stop]),
        lps: [],
        want_lps: opts[:logprobs] == true or (opts[:top_logprobs] || 0) > 0
      }
    else
      {:error, reason} -> {:failed, reason}
    end
  end

  defp start_source(server, true, _model, tokens, opts) do
    ref = make_ref()
    req_opts = Keyword.delete(opts, :json_schema)

    case Server.subscribe_stream_tokens(server, tokens, ref, req_opts) do
      :ok -> {:ok, {:server, server, ref}}
      {:error, reason} -> {:error, reason}
    end
  end

  defp start_source(model, false, _model, tokens, opts) do
    with {:ok, max_tokens} <- max_tokens(opts),
         {:ok, ctx, sampler} <- setup(model, tokens, max_tokens, opts) do
      {:ok, gen} =
        Generator.start(fn {caller, ref, cancel} ->
          NIF.generate_tokens(ctx.ref, sampler.ref, tokens, max_tokens, caller, ref, cancel)
        end)

      {:ok, {:local, gen}}
    end
  end

  defp next_chat_chunk({:failed, reason}), do: {[{:error, reason}], :finished}
  defp next_chat_chunk(:finished), do: {:halt, :finished}
  defp next_chat_chunk(%{phase: :done} = st), do: {:halt, st}

  defp next_chat_chunk(%{phase: :role} = st) do
    {[chunk(st, %{role: "assistant", content: ""}, nil)], %{st | phase: :streaming}}
  end

  defp next_chat_chunk(%{phase: :streaming, source: source} = st) do
    ref = source_ref(source)

    receive do
      {^ref, msg} ->
        case normalize_msg(msg) do
          {:logprob, entry} ->
            next_chat_chunk(%{st | lps: [entry | st.lps]})

          {:piece, piece, entry} ->
            chat_piece(%{st | lps: [entry | st.lps]}, piece)

          {:piece, piece} ->
            chat_piece(st, piece)

          {:done, reason} ->
            {deltas, st} = route(%{st | pending: ""}, stop_flush(st.matcher) <> st.pending)
            {chunks, st} = delta_chunks(st, deltas)
            {chunks ++ [chunk(st, %{}, finish_reason(reason))], %{st | phase: :done}}

          {:error, reason} ->
            {deltas, st} = route(%{st | pending: ""}, st.pending)
            {chunks, st} = delta_chunks(st, deltas)
            {chunks ++ [{:error, reason}], %{st | phase: :done}}
        end
    after
      st.timeout -> {[{:error, :timeout}], %{st | phase: :done}}
    end
  end

  defp chat_piece(st, piece) do
    {emit, pending} = UTF8Stream.push(st.pending, piece)

    case stop_push(st.matcher, emit) do
      {:cont, emit, matcher} ->
        {deltas, st} = route(%{st | pending: pending, matcher: matcher}, emit)
        delta_chunks(st, deltas)

      {:stop, emit} ->
        {deltas, st} = route(%{st | pending: "", matcher: nil}, emit)
        {chunks, st} = delta_chunks(st, deltas)
        {chunks ++ [chunk(st, %{}, "stop")], %{st | phase: :done}}
    end
  end

  # Content chunks; the log-probabilities of the tokens behind them ride on the first one.
  defp delta_chunks(st, []), do: {[], st}

  defp delta_chunks(st, deltas) do
    [first | rest] = Enum.map(deltas, &chunk(st, &1, nil))

    if st.want_lps and st.lps != [] do
      content = st.lps |> Enum.reverse() |> Enum.map(&openai_logprob/1)
      [choice] = first.choices
      first = %{first | choices: [Map.put(choice, :logprobs, %{content: content})]}
      {[first | rest], %{st | lps: []}}
    else
      {[first | rest], st}
    end
  end

  defp normalize_msg({:token, _id, piece}), do: {:piece, piece}
  defp normalize_msg({:token, _id, piece, logprobs}), do: {:piece, piece, {piece, logprobs}}
  defp normalize_msg({:token, piece}), do: {:piece, piece}
  defp normalize_msg({:logprob, entry}), do: {:logprob, entry}
  defp normalize_msg(:eog), do: {:done, :eog}
  defp normalize_msg(:done), do: {:done, :max_tokens}
  defp normalize_msg({:done, reason}), do: {:done, reason}
  defp normalize_msg({:error, reason}), do: {:error, reason}

  defp route(st, ""), do: {[], st}
  defp route(%{parser: nil} = st, text), do: {[%{content: text}], st}

  defp route(st, text) do
    {events, parser} = Thinking.feed(st.parser, text)

    deltas =
      Enum.map(events, fn
        {:thinking, t} -> %{reasoning_content: t}
        {:content, t} -> %{content: t}
      end)

    {deltas, %{st | parser: parser}}
  end

  defp chunk(st, delta, finish) do
    %{st.base | choices: [%{index: 0, delta: delta, finish_reason: finish}]}
  end

  defp source_ref({:server, _, ref}), do: ref
  defp source_ref({:local, gen}), do: gen.ref

  defp stop_chat_stream(%{source: {:local, gen}}), do: Generator.stop(gen)

  defp stop_chat_stream(%{source: {:server, server, ref}, phase: phase}) do
    if phase != :done, do: Server.cancel(server, ref)
    Generator.drain(ref)
  end

  defp stop_chat_stream(_), do: :ok

  # `:json_schema` becomes a `:grammar` before routing (both routes): llguidance compiles the
  # schema; conversion errors raise like `Grammar.from_json_schema!/1`.
  defp resolve_grammar_opts!(opts) do
    if present?(opts[:grammar]) and present?(opts[:json_schema]) do
      raise ArgumentError, "cannot use both :grammar and :json_schema options"
    end

    case Keyword.pop(opts, :json_schema) do
      {schema, rest} when schema in [nil, ""] ->
        rest

      {schema, rest} ->
        Keyword.put(rest, :grammar, Grammar.json_schema_constraint!(schema))
    end
  end

  defp present?(nil), do: false
  defp present?(""), do: false
  defp present?(_), do: true

  defp max_tokens(opts) do
    case Keyword.get(opts, :max_tokens, 256) do
      n when is_integer(n) and n > 0 -> {:ok, n}
      other -> {:error, "max_tokens must be a positive integer, got #{inspect(other)}"}
    end
  end

  defp prompt_tokens(model, prompt) when is_binary(prompt) do
    case Tokenizer.encode(model, prompt) do
      {:ok, []} -> {:error, "prompt cannot be empty"}
      other -> other
    end
  end

  defp prompt_tokens(_model, prompt),
    do: {:error, "prompt must be a string, got #{inspect(prompt)}"}

  defp setup(model, tokens, max_tokens, opts) do
    n_ctx = Keyword.get(opts, :n_ctx, 2048)

    if is_integer(n_ctx) and n_ctx > 0 do
      create_context_and_sampler(model, tokens, max_tokens, n_ctx, opts)
    else
      {:error, "n_ctx must be a positive integer, got #{inspect(n_ctx)}"}
    end
  end

  defp create_context_and_sampler(model, tokens, max_tokens, n_ctx, opts) do
    ctx_opts =
      opts
      |> Keyword.take(Context.tuning_option_keys())
      |> Keyword.put(:n_ctx, max(n_ctx, length(tokens) + max_tokens))

    sampler_opts =
      Keyword.take(opts, Sampler.option_keys() ++ Sampler.logprob_keys() ++ Sampler.extra_keys())

    with {:ok, ctx} <- Context.create(model, ctx_opts),
         {:ok, sampler} <- Sampler.create(model, sampler_opts) do
      {:ok, ctx, sampler}
    end
  end
end
