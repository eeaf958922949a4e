defmodule LlamaCppEx.Stepper do
  @moduledoc false
  # A generation driven by its caller, one engine step at a time, on sequence 0 of a
  # context: the model route's private context (`start/2`), or a context the caller made
  # (`on_context/4`, `LlamaCppEx.Context.generate/4`). Each step is a chunk of the prompt, or
  # the last sampled token (with a draft after it when speculating), run by the engine's one
  # step (`LlamaCppEx.Engine.run/2`) on a dirty scheduler; the caller can stop between any
  # two, so halting a stream, a timeout or the caller's death stops native work within one
  # step.

  alias LlamaCppEx.{Context, Engine, Generation, Limits, Pipeline, Sampler}
  alias LlamaCppEx.Engine.{Outcome, Sampled, Spec, Step}

  @enforce_keys [:ctx, :sampler, :pipeline, :prompt, :chunk]
  defstruct [
    :ctx,
    :sampler,
    :pipeline,
    :prompt,
    :chunk,
    :next_token,
    :spec,
    pos: 0,
    # KV operations for the next step (a context of the caller's starts with sequence 0
    # cleared)
    ops: [],
    # speculation: the tokens fed since the last speculating step, newest first, and
    # whether the next one starts the engine's history over
    unsent: [],
    spec_reset: true,
    n_drafted: 0,
    n_accepted: 0,
    # the tokens the last step sampled that the pipeline took, in order (ids for callers
    # that report them); speculating steps; engine time in steps and, of it, drafting
    pushed: [],
    spec_steps: 0,
    engine_us: 0,
    draft_us: 0
  ]

  @type t :: %__MODULE__{
          ctx: Context.t(),
          sampler: Sampler.t(),
          pipeline: Pipeline.t(),
          prompt: [non_neg_integer()],
          chunk: pos_integer(),
          next_token: non_neg_integer() | nil,
          spec: %{n_draft: pos_integer(), draft_model?: boolean()} | nil,
          pos: non_neg_integer(),
          ops: [Step.kv_op()],
          unsent: [non_neg_integer()],
          spec_reset: boolean(),
          n_drafted: non_neg_integer(),
          n_accepted: non_neg_integer(),
          pushed: [Sampled.t()],
          spec_steps: non_neg_integer(),
          engine_us: non_neg_integer(),
          draft_us: non_neg_integer()
        }

  @doc """
  A generation of a prepared request on a context of its own, sized by
  `LlamaCppEx.Generation.context_size/4`; `opts` holds the context options (`:n_ctx`,
  `:n_batch`, tuning keys).
  """
  @spec start(Generation.t(), keyword()) :: {:ok, t()} | {:error, term()}
  def start(%Generation{} = gen, opts) do
    n_prompt = length(gen.tokens)

    with {:ok, size} <-
           Generation.context_size(gen.model, n_prompt, gen.max_tokens, opts[:n_ctx]),
         ctx_opts =
           opts |> Keyword.take(Context.tuning_option_keys()) |> Keyword.put(:n_ctx, size),
         {:ok, ctx} <- Context.create(gen.model, ctx_opts),
         :ok <- attach_draft(ctx, gen.speculative, ctx_opts) do
      # the context's end ends generation like max_tokens
      pipeline = Pipeline.new(gen, min(gen.max_tokens, size - n_prompt))
      chunk = min(opts[:n_batch] || Limits.engine().default_ubatch, size)
      {:ok, new(ctx, gen.sampler, gen.tokens, pipeline, chunk, gen.speculative)}
    end
  end

  @doc """
  A generation of `tokens` (checked by the caller) on sequence 0 of `ctx`, cleared first,
  with `sampler`: no stop strings, no log-probabilities, up to `max_tokens` tokens.
  """
  @spec on_context(Context.t(), Sampler.t(), [non_neg_integer()], pos_integer()) :: t()
  def on_context(%Context{} = ctx, %Sampler{} = sampler, tokens, max_tokens) do
    pipeline = Pipeline.new(%{stop: nil, logprobs: false}, max_tokens)
    chunk = min(Context.n_ctx(ctx), Limits.engine().default_ubatch)
    %{new(ctx, sampler, tokens, pipeline, chunk, nil) | ops: [{:clear, 0}]}
  end

  @doc """
  A prepared request (`gen`, prepared for a context of `Context.n_ctx(ctx)` tokens) on
  sequence 0 of `ctx`, cleared first; speculation drafts with the draft model attached to
  `ctx` (`LlamaCppEx.Context.attach_draft/3`).
  """
  @spec on_context(Context.t(), Generation.t()) :: t()
  def on_context(%Context{} = ctx, %Generation{} = gen) do
    size = Context.n_ctx(ctx)
    pipeline = Pipeline.new(gen, min(gen.max_tokens, size - length(gen.tokens)))
    chunk = min(size, Limits.engine().default_ubatch)
    %{new(ctx, gen.sampler, gen.tokens, pipeline, chunk, gen.speculative) | ops: [{:clear, 0}]}
  end

  defp new(ctx, sampler, tokens, pipeline, chunk, spec) do
    %__MODULE__{
      ctx: ctx,
      sampler: sampler,
      pipeline: pipeline,
      prompt: tokens,
      chunk: chunk,
      spec: spec && Map.take(spec, [:n_draft, :draft_model?]),
      unsent: if(spec, do: Enum.reverse(tokens), else: [])
    }
  end

  # the draft model's context mirrors the target's (size, batch, threads, KV types)
  defp attach_draft(ctx, %{draft_model?: true, draft_model: draft}, ctx_opts),
    do: Context.attach_draft(ctx, draft, ctx_opts)

  defp attach_draft(_ctx, _spec, _ctx_opts), do: :ok

  @doc "Runs one step: `{:cont, events, s}` or `{:done, events, s}` (the request ended)."
  @spec step(t()) :: {:cont | :done, [Pipeline.event()], t()}
  def step(%__MODULE__{prompt: [_ | _] = prompt} = s) do
    {chunk, rest} = Enum.split(prompt, s.chunk)
    last = rest == []
    n = length(chunk)

    entries =
      chunk
      |> Enum.with_index()
      |> Enum.map(fn {t, i} -> {t, s.pos + i, 0, last and i == n - 1} end)

    step = %Step{
      ops: s.ops,
      entries: entries,
      samplers: if(last, do: [{0, s.sampler.ref}], else: [])
    }

    run(%{s | prompt: rest, pos: s.pos + n, ops: []}, step)
  end

  def step(%__MODULE__{next_token: token} = s) do
    step = %Step{entries: [{token, s.pos, 0, true}], samplers: [{0, s.sampler.ref}]}

    case s.spec do
      nil ->
        run(%{s | pos: s.pos + 1}, step)

      spec ->
        sent = %Spec{
          seq: 0,
          tokens: Enum.reverse(s.unsent),
          reset: s.spec_reset,
          n_draft: spec.n_draft,
          draft_model: spec.draft_model?
        }

        run(%{s | unsent: [], spec_reset: false}, %{step | specs: [sent]})
    end
  end

  defp run(s, step) do
    s = %{s | pushed: []}

    case Engine.run(s.ctx.ref, step) do
      {:ok, %Outcome{failed: [_ | _]}} ->
        {:done, Pipeline.fail(s.pipeline, :context_full), s}

      {:ok, %Outcome{sampled: sampled, drafted: drafted} = o} ->
        n_drafted = Enum.reduce(drafted, 0, fn {_, n}, acc -> acc + n end)

        s = %{
          s
          | n_drafted: s.n_drafted + n_drafted,
            spec_steps: s.spec_steps + if(step.specs == [], do: 0, else: 1),
            engine_us: s.engine_us + o.eval_us,
            draft_us: s.draft_us + o.draft_us
        }

        # a speculating step's first token sits at the position evaluated; the accepted
        # drafts after it are in the cache too
        s =
          if step.specs == [],
            do: s,
            else: %{
              s
              | pos: s.pos + length(sampled),
                n_accepted: s.n_accepted + max(length(sampled) - 1, 0)
            }

        push_all(s, sampled, [])

      {:error, reason} ->
        {:done, Pipeline.fail(s.pipeline, reason), s}
    end
  end

  # the sampled tokens through the pipeline, in order, until it ends
  defp push_all(s, [], events), do: {:cont, events, %{s | pushed: Enum.reverse(s.pushed)}}

  defp push_all(s, [%Sampled{} = t | rest], events) do
    s = %{
      s
      | next_token: t.token,
        unsent: if(s.spec, do: [t.token | s.unsent], else: []),
        pushed: [t | s.pushed]
    }

    case Pipeline.push(s.pipeline, t.piece, t.eog, t.logprobs) do
      {:cont, more, p} ->
        push_all(%{s | pipeline: p}, rest, events ++ more)

      {:done, more, p} ->
        {:done, events ++ more, %{s | pipeline: p, pushed: Enum.reverse(s.pushed)}}
    end
  end

  @doc "Draft tokens proposed and accepted so far (speculation)."
  @spec speculation(t()) :: {non_neg_integer(), non_neg_integer()}
  def speculation(%__MODULE__{n_drafted: d, n_accepted: a}), do: {d, a}

  @doc "Tokens generated so far (the end-of-generation token included)."
  @spec generated(t()) :: non_neg_integer()
  def generated(%__MODULE__{pipeline: p}), do: p.generated
end
