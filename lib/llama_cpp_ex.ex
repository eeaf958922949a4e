defmodule LlamaCppEx do
  @moduledoc """
  Local LLM inference for Elixir on a Rust/candle engine.

  `LlamaCppEx` loads GGUF models (the llama family), tokenizes with the model's own
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

  alias LlamaCppEx.{Context, Generator, Model, NIF, Options, Sampler, Tokenizer, UTF8Stream}

  @own_keys [:max_tokens, :n_ctx, :timeout, :grammar, :json_schema]

  @doc false
  def generation_option_keys,
    do: @own_keys ++ Sampler.option_keys() ++ Context.tuning_option_keys()

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
    check_grammar_opts!(opts)

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
    check_grammar_opts!(opts)
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

      {:running, gen, "", timeout}
    else
      {:error, reason} -> {:failed, reason}
    end
  end

  defp next_chunk({:failed, reason}), do: {[{:error, reason}], :finished}
  defp next_chunk(:finished), do: {:halt, :finished}

  defp next_chunk({:running, %{ref: ref} = gen, pending, timeout} = state) do
    receive do
      {^ref, {:token, _id, piece}} ->
        case UTF8Stream.push(pending, piece) do
          {"", pending} -> next_chunk({:running, gen, pending, timeout})
          {emit, pending} -> {[emit], {:running, gen, pending, timeout}}
        end

      {^ref, done} when done in [:eog, :done] ->
        {flush(pending), {:done, gen}}

      {^ref, {:error, reason}} ->
        {flush(pending) ++ [{:error, reason}], {:done, gen}}
    after
      timeout ->
        _ = state
        {[{:error, :timeout}], {:done, gen}}
    end
  end

  defp next_chunk({:done, _gen} = state), do: {:halt, state}

  defp flush(""), do: []
  defp flush(pending), do: [pending]

  defp stop_stream({:running, gen, _, _}), do: Generator.stop(gen)
  defp stop_stream({:done, gen}), do: Generator.stop(gen)
  defp stop_stream(_), do: :ok

  defp check_grammar_opts!(opts) do
    if present?(opts[:grammar]) and present?(opts[:json_schema]) do
      raise ArgumentError, "cannot use both :grammar and :json_schema options"
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
    if present?(opts[:json_schema]) or present?(opts[:grammar]) do
      {:error, "grammar-constrained sampling (:grammar, :json_schema) is not available yet"}
    else
      n_ctx = Keyword.get(opts, :n_ctx, 2048)

      if is_integer(n_ctx) and n_ctx > 0 do
        create_context_and_sampler(model, tokens, max_tokens, n_ctx, opts)
      else
        {:error, "n_ctx must be a positive integer, got #{inspect(n_ctx)}"}
      end
    end
  end

  defp create_context_and_sampler(model, tokens, max_tokens, n_ctx, opts) do
    ctx_opts =
      opts
      |> Keyword.take(Context.tuning_option_keys())
      |> Keyword.put(:n_ctx, max(n_ctx, length(tokens) + max_tokens))

    sampler_opts = Keyword.take(opts, Sampler.option_keys())

    with {:ok, ctx} <- Context.create(model, ctx_opts),
         {:ok, sampler} <- Sampler.create(model, sampler_opts) do
      {:ok, ctx, sampler}
    end
  end
end
