defmodule LlamaCppEx.Local do
  @moduledoc false
  # Generation on a model without a server: one sequence on a private context, driven from the
  # calling process one engine step at a time (a chunk of the prompt, then one token per step,
  # on a dirty scheduler). The caller can stop between any two steps, so halting a stream, a
  # timeout or the caller's death stops native work within one step.

  alias LlamaCppEx.{Context, Model, NIF, Options, Pipeline, Sampler}

  defstruct [
    :ctx,
    :sampler,
    :pipeline,
    :prompt,
    :pos,
    :chunk,
    :next_token,
    :n_prompt,
    # speculation: draft length (nil = off), whether drafts come from the context's draft
    # model (else prompt lookup), the sequence so far (newest first) and counters
    :n_draft,
    draft_model?: false,
    rev_history: [],
    n_drafted: 0,
    n_accepted: 0
  ]

  @type t :: %__MODULE__{}

  @default_n_ctx 2048
  @default_chunk 512

  @doc """
  A session for `tokens` with generation options (`:max_tokens`, `:n_ctx`, `:stop`,
  sampler and context tuning keys). The context holds `max(n_ctx, prompt + max_tokens)`
  tokens, at most the model's training context unless `:n_ctx` asks for more; a prompt
  longer than that limit (or than an explicit `:n_ctx`) is an error before anything runs.
  """
  @spec start(Model.t(), [non_neg_integer()], keyword()) :: {:ok, t()} | {:error, term()}
  def start(%Model{} = model, tokens, opts) do
    spec = Options.speculative!(Keyword.get(opts, :speculative))

    if spec && spec.mode == :draft && spec.draft_model == nil do
      raise ArgumentError, "speculative mode :draft needs a :draft_model (a Model or a path)"
    end

    n_draft = spec && spec.n_draft
    n_prompt = length(tokens)
    max_tokens = Keyword.fetch!(opts, :max_tokens)
    explicit = Keyword.get(opts, :n_ctx)
    n_ctx = explicit || @default_n_ctx
    limit = explicit || Model.n_ctx_train(model)
    size = min(max(n_ctx, n_prompt + max_tokens), max(Model.n_ctx_train(model), n_ctx))

    cond do
      n_prompt == 0 ->
        {:error, "prompt cannot be empty"}

      n_prompt >= limit ->
        {:error,
         "the prompt has #{n_prompt} tokens, more than fit the context of #{limit} tokens " <>
           "(the model's training context, or :n_ctx)"}

      true ->
        ctx_opts =
          opts
          |> Keyword.take(Context.tuning_option_keys())
          |> Keyword.put(:n_ctx, size)

        with {:ok, ctx} <- Context.create(model, ctx_opts),
             :ok <- attach_draft(ctx, spec, ctx_opts),
             {:ok, sampler} <- Sampler.create(model, Keyword.take(opts, Sampler.all_keys())) do
          {:ok,
           %__MODULE__{
             ctx: ctx,
             sampler: sampler,
             # the context's end ends generation like max_tokens
             pipeline:
               Pipeline.new(Keyword.put(opts, :max_tokens, min(max_tokens, size - n_prompt))),
             prompt: tokens,
             pos: 0,
             chunk: min(Keyword.get(opts, :n_batch) || @default_chunk, size),
             n_prompt: n_prompt,
             n_draft: n_draft,
             draft_model?: spec != nil and spec.mode == :draft,
             rev_history: if(n_draft, do: Enum.reverse(tokens), else: [])
           }}
        end
    end
  end

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

    s = %{s | prompt: rest, pos: s.pos + n}
    run(s, entries, last)
  end

  def step(%__MODULE__{next_token: token, n_draft: nil} = s) do
    run(%{s | pos: s.pos + 1}, [{token, s.pos, 0, true}], true)
  end

  def step(%__MODULE__{next_token: token, n_draft: n_draft} = s) do
    history = Enum.reverse(s.rev_history)

    case NIF.context_speculate(
           s.ctx.ref,
           s.sampler.ref,
           token,
           s.pos,
           history,
           n_draft,
           s.draft_model?
         ) do
      {:ok, {tokens, n_drafted}} ->
        s = %{
          s
          | pos: s.pos + length(tokens),
            n_drafted: s.n_drafted + n_drafted,
            n_accepted: s.n_accepted + length(tokens) - 1
        }

        push_all(s, tokens, [])

      {:error, reason} ->
        {:done, Pipeline.fail(s.pipeline, reason), s}
    end
  end

  # the verified tokens through the pipeline, in order, until it ends
  defp push_all(s, [], events), do: {:cont, events, s}

  defp push_all(s, [{token, piece, eog, logprobs} | rest], events) do
    s = %{s | rev_history: [token | s.rev_history], next_token: token}

    case Pipeline.push(s.pipeline, piece, eog, logprobs) do
      {:cont, more, p} -> push_all(%{s | pipeline: p}, rest, events ++ more)
      {:done, more, p} -> {:done, events ++ more, %{s | pipeline: p}}
    end
  end

  # the draft model's context mirrors the target's (size, batch, threads, KV types)
  defp attach_draft(ctx, %{mode: :draft, draft_model: draft}, ctx_opts),
    do: Context.attach_draft(ctx, draft, ctx_opts)

  defp attach_draft(_ctx, _spec, _ctx_opts), do: :ok

  @doc "Draft tokens proposed and accepted so far (speculation)."
  @spec speculation(t()) :: {non_neg_integer(), non_neg_integer()}
  def speculation(%__MODULE__{n_drafted: d, n_accepted: a}), do: {d, a}

  defp run(s, entries, sample?) do
    samplers = if sample?, do: [{0, s.sampler.ref}], else: []

    case NIF.context_step(s.ctx.ref, {[], entries, samplers, {[], 0}, [], []}) do
      {:ok, {[{0, token, piece, eog, logprobs}], _, _, _, _, _, _}} ->
        s = if s.n_draft, do: %{s | rev_history: [token | s.rev_history]}, else: s

        case Pipeline.push(s.pipeline, piece, eog, logprobs) do
          {:cont, events, p} -> {:cont, events, %{s | pipeline: p, next_token: token}}
          {:done, events, p} -> {:done, events, %{s | pipeline: p}}
        end

      {:ok, {[], _, _, [], _, _, _}} ->
        {:cont, [], s}

      {:ok, {_, _, _, [_ | _], _, _, _}} ->
        {:done, Pipeline.fail(s.pipeline, :context_full), s}

      {:error, reason} ->
        {:done, Pipeline.fail(s.pipeline, reason), s}
    end
  end

  @doc "Tokens generated so far (the end-of-generation token included)."
  @spec generated(t()) :: non_neg_integer()
  def generated(%__MODULE__{pipeline: p}), do: p.generated

  @doc "Prompt tokens."
  @spec n_prompt(t()) :: non_neg_integer()
  def n_prompt(%__MODULE__{n_prompt: n}), do: n
end
