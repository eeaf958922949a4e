defmodule LlamaCppEx.MTP do
  @moduledoc """
  `llama_cpp_ex`'s multi-token-prediction sessions, on this library's speculative decoding.

  A session is a context of the target model with a draft model attached: each step drafts
  `:n_draft` tokens with the draft model and verifies them in one pass of the target, and the
  text is exactly the text without speculation (lossless for every sampler; see
  `LlamaCppEx.generate/3`'s `:speculative`).

      {:ok, target} = LlamaCppEx.load_model("Qwen2.5-1.5B-Instruct-Q4_K_M.gguf")
      {:ok, draft} = LlamaCppEx.load_model("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", load_mtp: true)
      {:ok, mtp} = LlamaCppEx.MTP.init(target, draft_model: draft, n_draft: 4)
      {:ok, text} = LlamaCppEx.MTP.generate(mtp, "The capital of France is", max_tokens: 32)
      LlamaCppEx.MTP.stats(mtp).acceptance_rate

  ## What differs from `llama_cpp_ex`

  This engine has no MTP heads: a GGUF's nextn layers are never loaded
  (`LlamaCppEx.Model.n_layer_nextn/1` is 0), so a session needs a `:draft_model`, and
  `init/2` without one answers with `llama_cpp_ex`'s messages for a model that has no usable
  head. The draft is a whole small model sharing the target's vocabulary (not a sidecar of
  the target's width, so the width check of `llama_cpp_ex` does not apply; a vocabulary
  mismatch is the error instead). It must still be loaded with `load_mtp: true`, as there.

  One session serves one generation at a time (its context holds one sequence). Abandoning a
  stream and reusing the session is safe: every generation starts from a cleared sequence.
  """

  alias LlamaCppEx.{Context, Generation, Model, Options, Sampler, Source}

  @enforce_keys [:main_ctx, :mtp_ctx, :spec_ref, :n_draft]
  defstruct [:main_ctx, :mtp_ctx, :spec_ref, :n_draft]

  @typedoc """
  `main_ctx`: the target's context, the draft's context attached to it; `mtp_ctx`: the draft
  model; `spec_ref`: the session's counters (`stats/1`); `n_draft`: tokens drafted per step.
  """
  @type t :: %__MODULE__{
          main_ctx: Context.t(),
          mtp_ctx: Model.t(),
          spec_ref: :counters.counters_ref(),
          n_draft: pos_integer()
        }

  @defaults [n_draft: 3, n_ctx: 2048]
  @call_defaults [max_tokens: 256, emit_stats_every: 0, timeout: 60_000]
  # counters: steps, drafted, accepted, emitted, wall µs, engine µs, drafting µs
  @counters [:iters, :drafted, :accepted, :emitted, :total_us, :engine_us, :draft_us]

  @doc """
  A session on `model`: `{:ok, %MTP{}}` or `{:error, message}`. Options: `:n_draft`
  (default 3), `:n_ctx` (default 2048), `:draft_model` (a `LlamaCppEx.Model` loaded with
  `load_mtp: true`), and `LlamaCppEx.Context` tuning options.
  """
  @spec init(Model.t(), keyword()) :: {:ok, t()} | {:error, String.t()}
  def init(%Model{} = model, opts \\ []) do
    Options.validate!(
      opts,
      Keyword.keys(@defaults) ++ [:draft_model | Context.tuning_option_keys()],
      "LlamaCppEx.MTP.init/2"
    )

    opts = Keyword.merge(@defaults, opts)
    draft = opts[:draft_model]

    with :ok <- check_n_draft(opts[:n_draft]),
         :ok <- check_draft(draft),
         :ok <- check_head(model, draft),
         ctx_opts = [n_ctx: opts[:n_ctx]] ++ Keyword.take(opts, Context.tuning_option_keys()),
         {:ok, ctx} <- Context.create(model, ctx_opts),
         :ok <- Context.attach_draft(ctx, draft, ctx_opts) do
      {:ok,
       %__MODULE__{
         main_ctx: ctx,
         mtp_ctx: draft,
         spec_ref: :counters.new(length(@counters), [:atomics]),
         n_draft: opts[:n_draft]
       }}
    end
  end

  defp check_n_draft(n) when is_integer(n) and n > 0, do: :ok
  defp check_n_draft(_), do: {:error, ":n_draft must be a positive integer"}

  defp check_draft(nil), do: :ok
  defp check_draft(%Model{load_mtp: true}), do: :ok

  defp check_draft(%Model{}),
    do:
      {:error,
       "draft_model was loaded without load_mtp: true; reload it with " <>
         "LlamaCppEx.Model.load(path, load_mtp: true)"}

  defp check_draft(other),
    do: {:error, ":draft_model must be a LlamaCppEx.Model, got: #{inspect(other, limit: 5)}"}

  defp check_head(_model, %Model{}), do: :ok

  defp check_head(%Model{load_mtp: false}, nil),
    do:
      {:error,
       "model was loaded without load_mtp: true, so no MTP head was kept; reload it with " <>
         "LlamaCppEx.Model.load(path, load_mtp: true), or pass a :draft_model"}

  # this engine loads no nextn layers, so a model alone never has a head to draft with
  defp check_head(model, nil) do
    {:error,
     "this GGUF contains no MTP head (#{Model.n_layer_nextn(model)} nextn layers): use an " <>
       "MTP-preserving conversion of the model, or pass a :draft_model (a smaller model " <>
       "sharing its vocabulary)"}
  end

  @doc """
  The text for `prompt`: `{:ok, text}` or `{:error, reason}`. Options: `:max_tokens`
  (default 256, an exact bound), `:timeout` (default 60_000 ms per step) and sampler options.
  """
  @spec generate(t(), String.t() | [integer()], keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def generate(%__MODULE__{} = mtp, prompt, opts \\ []) do
    mtp
    |> events(prompt, opts, "LlamaCppEx.MTP.generate/3", :text)
    |> Enum.reduce_while([], fn
      {:text, t}, acc -> {:cont, [acc | t]}
      {:error, reason}, _ -> {:halt, {:error, reason}}
      _, acc -> {:cont, acc}
    end)
    |> case do
      {:error, _} = error -> error
      text -> {:ok, IO.iodata_to_binary(text)}
    end
  end

  @doc """
  The text for `prompt` as a stream of binaries (UTF-8 safe), then `{:error, reason}` if it
  failed. Options as `generate/3`.
  """
  @spec stream(t(), String.t() | [integer()], keyword()) :: Enumerable.t()
  def stream(%__MODULE__{} = mtp, prompt, opts \\ []) do
    mtp
    |> events(prompt, opts, "LlamaCppEx.MTP.stream/3", :text)
    |> Stream.flat_map(fn
      {:text, t} -> [t]
      {:error, _} = e -> [e]
      _ -> []
    end)
  end

  @doc """
  The generation as events: `{:token, id, piece}` per token (the piece is the token's bytes,
  which may be part of a UTF-8 character), `{:stats, map}` every `:emit_stats_every` tokens
  (0, the default: never), then one of `{:done, stats}` (`:max_tokens` reached),
  `{:eog, nil}` (end of generation) or `{:error, reason}` (`{:error, :timeout}` included).
  A request that cannot start (a grammar that does not compile) is `[{:error, reason}]`.
  """
  @spec stream_events(t(), String.t() | [integer()], keyword()) :: Enumerable.t()
  def stream_events(%__MODULE__{} = mtp, prompt, opts \\ []),
    do: events(mtp, prompt, opts, "LlamaCppEx.MTP.stream_events/3", :pieces)

  # The request's events, tokens as `{:token, id, piece}` (`:pieces`) or as the UTF-8-safe
  # `{:text, t}` of the rest of the library (`:text`); the session's counters take the
  # generation's when it ends or is abandoned.
  defp events(mtp, prompt, opts, label, shape) do
    Options.validate!(opts, Keyword.keys(@call_defaults) ++ Sampler.all_keys(), label)
    opts = Keyword.merge(@call_defaults, opts)
    every = opts[:emit_stats_every]
    timeout = Options.timeout(opts, :blocking)
    gen_opts = Generation.options!(Keyword.drop(opts, [:emit_stats_every, :timeout]), :server)

    Stream.resource(
      fn ->
        with :ok <- Options.check(:emit_stats_every, every, {:int, 0, 2_147_483_647}),
             {:ok, gen} <- prepare(mtp, prompt, gen_opts) do
          {:open, %{src: Source.on_context(mtp.main_ctx, gen, timeout), n: 0, t0: now()}}
        else
          {:error, reason} -> {:failed, reason}
        end
      end,
      fn
        {:failed, reason} -> {[{:error, reason}], :closed}
        {:open, st} -> next(st, mtp, every, shape)
        done -> {:halt, done}
      end,
      fn
        {tag, st} when tag in [:open, :finished] -> add(mtp, counts(st))
        _ -> :ok
      end
    )
  end

  defp prepare(mtp, prompt, opts) do
    spec = %{n_draft: mtp.n_draft, draft_model?: true, draft_model: nil}
    # a fixed context with its own draft model: the shape of a server's requests
    n_ctx = Context.n_ctx(mtp.main_ctx)
    route = {:server, %{n_ctx: n_ctx, sampler_defaults: [], draft_model?: true}}
    Generation.prepare(mtp.main_ctx.model, prompt, Keyword.put(opts, :speculative, spec), route)
  end

  defp next(%{src: src, n: n} = st, mtp, every, shape) do
    {status, events, src} = Source.next(src)
    pushed = for t <- src.stepper.pushed, not t.eog, do: t
    st = %{st | src: src, n: n + length(pushed)}

    tokens =
      case shape do
        :pieces -> for t <- pushed, do: {:token, t.token, t.piece}
        :text -> for {:token, t} <- events, do: {:text, t}
      end

    stats =
      if every > 0 and div(st.n, every) > div(n, every),
        do: [{:stats, session_stats(mtp, st)}],
        else: []

    ending =
      Enum.flat_map(events, fn
        {:done, :eog} -> [{:eog, nil}]
        {:done, _} -> [{:done, session_stats(mtp, st)}]
        {:error, _} = e -> [e]
        _ -> []
      end)

    if status == :done,
      do: {tokens ++ stats ++ ending, {:finished, st}},
      else: {tokens ++ stats, {:open, st}}
  end

  defp now, do: System.monotonic_time(:microsecond)

  # what a generation adds to the session's counters
  defp counts(%{src: %{stepper: s}, n: n, t0: t0}) do
    %{
      iters: s.spec_steps,
      drafted: s.n_drafted,
      accepted: s.n_accepted,
      emitted: n,
      total_us: now() - t0,
      engine_us: s.engine_us,
      draft_us: s.draft_us
    }
  end

  defp add(%__MODULE__{spec_ref: ref}, counts) do
    for {k, i} <- Enum.with_index(@counters, 1), do: :counters.add(ref, i, counts[k])
    :ok
  end

  # the session's counters with the running generation's
  defp session_stats(mtp, st) do
    current = counts(st)

    @counters
    |> Enum.with_index(1)
    |> Map.new(fn {k, i} -> {k, :counters.get(mtp.spec_ref, i) + current[k]} end)
    |> stats_map(mtp.n_draft)
  end

  @doc """
  The session's counters over the generations that ended: `iters` (speculating steps), `drafts_generated`,
  `drafts_accepted`, `acceptance_rate` (0..1), `tokens_emitted`, `tokens_per_sec`, `n_draft`
  and `timing_us: %{draft, verify, sample, ckpt, other, total}`. `verify` is the target's
  passes, sampling included (`sample` is 0); no checkpoints are taken (`ckpt` is 0: rejected
  drafts are dropped from the cache by position).
  """
  @spec stats(t()) :: map()
  def stats(%__MODULE__{spec_ref: ref, n_draft: n_draft}) do
    c = Map.new(Enum.with_index(@counters, 1), fn {k, i} -> {k, :counters.get(ref, i)} end)
    stats_map(c, n_draft)
  end

  @doc "Prints `stats/1` to standard output."
  @spec print_stats(t()) :: :ok
  def print_stats(%__MODULE__{} = mtp) do
    s = stats(mtp)

    IO.puts(
      "MTP: #{s.iters} steps, #{s.drafts_accepted}/#{s.drafts_generated} drafts accepted " <>
        "(#{Float.round(s.acceptance_rate * 100, 1)}%), #{s.tokens_emitted} tokens, " <>
        "#{Float.round(s.tokens_per_sec, 1)} tok/s (n_draft #{s.n_draft})"
    )
  end

  defp stats_map(c, n_draft) do
    verify = c.engine_us - c.draft_us

    %{
      iters: c.iters,
      drafts_generated: c.drafted,
      drafts_accepted: c.accepted,
      acceptance_rate: if(c.drafted > 0, do: c.accepted / c.drafted, else: 0.0),
      tokens_emitted: c.emitted,
      tokens_per_sec: if(c.total_us > 0, do: c.emitted * 1.0e6 / c.total_us, else: 0.0),
      n_draft: n_draft,
      timing_us: %{
        draft: c.draft_us,
        verify: verify,
        sample: 0,
        ckpt: 0,
        other: max(c.total_us - c.engine_us, 0),
        total: c.total_us
      }
    }
  end
end
