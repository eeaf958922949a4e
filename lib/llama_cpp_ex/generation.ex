defmodule LlamaCppEx.Generation do
  @moduledoc """
  A generation request, prepared once at the edge for either route: on a model
  (`LlamaCppEx.generate/3` and friends) or on a `LlamaCppEx.Server`. Preparing applies the
  defaults, checks every value, tokenizes the prompt, checks its ids against the vocabulary
  and builds the request's sampler (its grammar compiled) in the calling process, so nothing
  malformed reaches a context or a server, and every route answers a condition the same way.

  ## Errors

  | condition | result |
  |---|---|
  | an unknown option, a malformed `:speculative`, `:grammar` and `:json_schema` together | `ArgumentError` |
  | a prompt that is neither a string nor a list | `{:error, "prompt must be a string or a list of token ids, got: ..."}` |
  | an empty prompt (no text, or no tokens) | `{:error, :empty_prompt}` |
  | a token id outside the vocabulary (or not a non-negative integer) | `{:error, :invalid_token}` |
  | a model that only embeds (a BERT encoder) | `{:error, :not_generative_model}` |
  | a prompt the context cannot hold | `{:error, :context_full}` |
  | a value of the wrong type or out of range (`:max_tokens`, `:stop`, sampler values) | `{:error, "invalid key: value"}` |
  | a grammar or JSON Schema that does not compile | `{:error, :invalid_grammar}` |
  | `speculative: [mode: :draft]` on a Server started without `:draft_model` | `{:error, "speculative mode :draft needs a Server started with :draft_model"}` |

  `:max_tokens` is 1 to `LlamaCppEx.Limits.engine().max_context_tokens` (default 256);
  `:top_logprobs` 0 to `LlamaCppEx.Limits.engine().max_top_logprobs`.
  """

  alias LlamaCppEx.{Chat, Grammar, Limits, Model, Options, Sampler, StopMatcher, Tokenizer}

  @enforce_keys [:model, :tokens, :max_tokens, :sampler]
  defstruct [:model, :tokens, :max_tokens, :sampler, :stop, :speculative, logprobs: false]

  @typedoc """
  `:speculative` is `nil` (off) or `%{n_draft: n, draft_model?: drafts from a draft model,
  draft_model: the model or path a model-route request brings}`.
  """
  @type t :: %__MODULE__{
          model: Model.t(),
          tokens: [non_neg_integer(), ...],
          max_tokens: pos_integer(),
          sampler: Sampler.t(),
          stop: String.t() | [String.t()] | nil,
          logprobs: boolean(),
          speculative:
            %{
              n_draft: pos_integer(),
              draft_model?: boolean(),
              draft_model: Model.t() | String.t() | nil
            }
            | nil
        }

  @default_max_tokens 256

  @doc "`:max_tokens` when none is given."
  @spec default_max_tokens() :: pos_integer()
  def default_max_tokens, do: @default_max_tokens

  @doc """
  The options of a request with what must fail in the caller at once (before a stream is
  consumed, before the model is touched) applied: `ArgumentError` for `:grammar` with
  `:json_schema` or a malformed `:speculative`; `:json_schema` becomes a `:grammar`
  (llguidance compiles the schema; a schema it cannot convert raises like
  `LlamaCppEx.Grammar.from_json_schema!/1`). `route` is `:model` or `:server`. Idempotent.
  """
  @spec options!(keyword(), :model | :server) :: keyword()
  def options!(opts, route) do
    # chat keys shape a template; by now the prompt is rendered or raw
    opts = opts |> Keyword.drop(Chat.option_keys()) |> resolve_json_schema!()

    case Keyword.fetch(opts, :speculative) do
      {:ok, spec} -> Keyword.put(opts, :speculative, speculative!(spec, route))
      :error -> opts
    end
  end

  @doc """
  Prepares `prompt` (a string, tokenized with the model's own tokenizer, special tokens
  parsed, or a list of token ids) with `opts` (checked by name by the caller and passed
  through `options!/2`).

  `route` is `:model` or `{:server, %{n_ctx: n, sampler_defaults: kw, draft_model?: bool}}`:
  a server request starts from the server's sampler defaults, drafts with the server's draft
  model and must leave room in its context.
  """
  @spec prepare(Model.t(), String.t() | [integer()], keyword(), :model | {:server, map()}) ::
          {:ok, t()} | {:error, term()}
  def prepare(%Model{} = model, prompt, opts, route) do
    spec = Keyword.get(opts, :speculative)
    max_tokens = Keyword.get(opts, :max_tokens, @default_max_tokens)
    defaults = if match?({:server, _}, route), do: elem(route, 1).sampler_defaults, else: []

    with :ok <- Options.check(:max_tokens, max_tokens, {:int, 1, Limits.max_context()}),
         :ok <- check_stop(opts[:stop]),
         :ok <- Options.check_all(opts, cache_prompt: :boolean),
         :ok <- check_draft_model(spec, route),
         :ok <- check_generative(model),
         {:ok, tokens} <- tokens(model, prompt),
         :ok <- check_fits(tokens, route),
         sampler_opts = Keyword.merge(defaults, Keyword.take(opts, Sampler.all_keys())),
         {:ok, sampler} <- Sampler.create(model, sampler_opts) do
      {:ok,
       %__MODULE__{
         model: model,
         tokens: tokens,
         max_tokens: max_tokens,
         sampler: sampler,
         stop: opts[:stop],
         logprobs: Sampler.logprobs?(sampler_opts),
         speculative: spec
       }}
    end
  end

  @doc """
  The token ids of `prompt`: a string tokenized (special tokens parsed), or a list of ids
  checked against the vocabulary. The one home of the prompt rules every request follows.
  """
  @spec tokens(Model.t(), term()) :: {:ok, [non_neg_integer(), ...]} | {:error, term()}
  def tokens(model, prompt) when is_binary(prompt) do
    case Tokenizer.encode(model, prompt) do
      {:ok, []} -> {:error, :empty_prompt}
      other -> other
    end
  end

  def tokens(_model, []), do: {:error, :empty_prompt}

  def tokens(model, ids) when is_list(ids) do
    n_vocab = Tokenizer.vocab_size(model)

    if Enum.all?(ids, &(is_integer(&1) and &1 >= 0 and &1 < n_vocab)),
      do: {:ok, ids},
      else: {:error, :invalid_token}
  end

  def tokens(_model, other),
    do:
      {:error, "prompt must be a string or a list of token ids, got: #{inspect(other, limit: 5)}"}

  @doc """
  The size of the private context a model-route request of `n_prompt` tokens gets:
  `max(n_ctx, prompt + max_tokens)`, at most the model's training context unless `:n_ctx`
  asks for more; `{:error, :context_full}` when the prompt does not fit that limit (the
  training context, or an explicit `:n_ctx`).
  """
  @spec context_size(Model.t(), non_neg_integer(), pos_integer(), pos_integer() | nil) ::
          {:ok, pos_integer()} | {:error, :context_full}
  def context_size(model, n_prompt, max_tokens, explicit) do
    n_ctx = explicit || Limits.engine().default_context_tokens
    train = Model.n_ctx_train(model)

    if n_prompt >= (explicit || train),
      do: {:error, :context_full},
      else: {:ok, min(max(n_ctx, n_prompt + max_tokens), max(train, n_ctx))}
  end

  # `:json_schema` becomes a `:grammar` (llguidance compiles the schema); conversion errors
  # raise like `Grammar.from_json_schema!/1`.
  defp resolve_json_schema!(opts) do
    if present?(opts[:grammar]) and present?(opts[:json_schema]) do
      raise ArgumentError, "cannot use both :grammar and :json_schema options"
    end

    case Keyword.pop(opts, :json_schema) do
      {schema, rest} when schema in [nil, ""] -> rest
      {schema, rest} -> Keyword.put(rest, :grammar, Grammar.json_schema_constraint!(schema))
    end
  end

  defp present?(v), do: v not in [nil, ""]

  defp check_stop(stop) do
    if StopMatcher.valid?(stop),
      do: :ok,
      else: {:error, "invalid stop: #{inspect(stop, limit: 5, printable_limit: 80)}"}
  end

  defp check_generative(model) do
    if Model.info(model).generative, do: :ok, else: {:error, :not_generative_model}
  end

  # a server refuses a prompt as long as its whole context at once
  defp check_fits(tokens, {:server, %{n_ctx: n_ctx}}) do
    if length(tokens) >= n_ctx, do: {:error, :context_full}, else: :ok
  end

  defp check_fits(_tokens, :model), do: :ok

  # a malformed `:speculative` raises in the caller, like an unknown option
  defp speculative!(%{n_draft: _} = resolved, _route), do: resolved

  defp speculative!(opt, route) do
    case {Options.speculative!(opt), route} do
      {nil, _} ->
        nil

      {%{mode: :draft, draft_model: nil}, :model} ->
        raise ArgumentError, "speculative mode :draft needs a :draft_model (a Model or a path)"

      {%{draft_model: m}, :server} when m != nil ->
        raise ArgumentError,
              "a Server's requests use its own draft model: pass :draft_model to " <>
                "start_link/1, not per request"

      {spec, _} ->
        %{n_draft: spec.n_draft, draft_model?: spec.mode == :draft, draft_model: spec.draft_model}
    end
  end

  defp check_draft_model(%{draft_model?: true}, {:server, %{draft_model?: false}}),
    do: {:error, "speculative mode :draft needs a Server started with :draft_model"}

  defp check_draft_model(_spec, _route), do: :ok
end
