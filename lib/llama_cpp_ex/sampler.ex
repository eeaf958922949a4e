defmodule LlamaCppEx.Sampler do
  @moduledoc """
  A token sampler with llama.cpp's stage order and semantics:

  logit bias → grammar → penalties → DRY → top-n-σ → top-k → typical → top-p → min-p → XTC →
  temperature (dynamic with `:dynatemp_range`) → seeded draw. With `temp: 0` the token is the
  argmax after bias, grammar, penalties and DRY. `mirostat: 1 | 2` replaces the truncation
  stages with temperature → Mirostat, as llama.cpp's common sampler does. Tokens with equal
  logits are ordered by token id (the lower first) at every stage, so the same `:seed` draws
  the same tokens from the same logits.

  When logit bias and grammar together leave no token at some step, the sampler returns the
  end-of-generation token: the request ends (`finish_reason: "stop"`) rather than ignore them.
  A `:logit_bias` that bans every token of the vocabulary is refused at creation.

  ## Example

      {:ok, sampler} = LlamaCppEx.Sampler.create(model, temp: 0.7, top_p: 0.9, seed: 42)
      {:ok, sampler} = LlamaCppEx.Sampler.create(model, grammar: ~S{root ::= "yes" | "no"})
  """

  alias LlamaCppEx.{Context, Limits, Model, NIF, Options}

  @enforce_keys [:ref]
  defstruct [:ref, :model]

  @type t :: %__MODULE__{ref: reference(), model: Model.t() | nil}

  @keys [
    :seed,
    :temp,
    :top_k,
    :top_p,
    :min_p,
    :penalty_repeat,
    :penalty_freq,
    :penalty_present,
    :grammar,
    :grammar_root
  ]

  @logprob_keys [:logprobs, :top_logprobs]

  @extra_keys [
    :penalty_last_n,
    :min_keep,
    :typical_p,
    :top_n_sigma,
    :xtc_probability,
    :xtc_threshold,
    :dry_multiplier,
    :dry_base,
    :dry_allowed_length,
    :dry_penalty_last_n,
    :dry_sequence_breakers,
    :mirostat,
    :mirostat_tau,
    :mirostat_eta,
    :dynatemp_range,
    :dynatemp_exponent,
    :logit_bias,
    :grammar_triggers
  ]

  @i32 {:int, -2_147_483_648, 2_147_483_647}
  @float {:number, -1.0e30, 1.0e30}

  @specs [
    seed: {:int, 0, 18_446_744_073_709_551_615},
    temp: @float,
    top_k: @i32,
    top_p: @float,
    min_p: @float,
    penalty_repeat: @float,
    penalty_freq: @float,
    penalty_present: @float,
    penalty_last_n: {:int, -1, 2_147_483_647},
    min_keep: {:int, 0, 2_147_483_647},
    typical_p: @float,
    top_n_sigma: @float,
    xtc_probability: @float,
    xtc_threshold: @float,
    dry_multiplier: @float,
    dry_base: @float,
    dry_allowed_length: @i32,
    dry_penalty_last_n: {:int, -1, 2_147_483_647},
    dry_sequence_breakers: {:list, :string},
    mirostat: {:in, [0, 1, 2]},
    mirostat_tau: @float,
    mirostat_eta: @float,
    dynatemp_range: @float,
    dynatemp_exponent: @float,
    grammar_root: :string,
    grammar_triggers: {:list, :string},
    logprobs: :boolean
  ]

  @doc "Sampling option keys."
  @spec option_keys() :: [atom()]
  def option_keys, do: @keys

  @doc "Log-probability reporting keys (accepted by `create/2` and every generation route)."
  @spec logprob_keys() :: [atom()]
  def logprob_keys, do: @logprob_keys

  @doc """
  Sampler keys beyond `option_keys/0` (accepted by `create/2`, every generation route and
  per Server request): `#{inspect(@extra_keys)}`.
  """
  @spec extra_keys() :: [atom()]
  def extra_keys, do: @extra_keys

  @doc false
  # Every key `create/2` accepts.
  def all_keys, do: @keys ++ @logprob_keys ++ @extra_keys

  @doc false
  # The rule for whether a request reports log-probabilities, for every route: `logprobs:
  # true`, or some `:top_logprobs`.
  @spec logprobs?(keyword()) :: boolean()
  def logprobs?(opts),
    do: Keyword.get(opts, :logprobs, false) == true or Keyword.get(opts, :top_logprobs, 0) > 0

  # the value ranges; the largest `:top_logprobs` is the engine's
  defp specs, do: [{:top_logprobs, {:int, 0, Limits.engine().max_top_logprobs}} | @specs]

  @doc """
  The defaults of every sampling option but `:seed` (random) and `:grammar` (none), as the
  engine defines them.

      iex> LlamaCppEx.Sampler.defaults().top_k
      40
  """
  @spec defaults() :: map()
  def defaults do
    case :persistent_term.get({__MODULE__, :defaults}, nil) do
      nil ->
        d =
          Map.drop(NIF.sampler_defaults(), [
            :seed,
            :grammar,
            :grammar_root,
            :logit_bias,
            :logit_ban,
            :logprobs
          ])

        :persistent_term.put({__MODULE__, :defaults}, d)
        d

      d ->
        d
    end
  end

  @doc """
  Checks the `:grammar` (with `:grammar_root`) in `opts` against the model's vocabulary.
  A `nil` or `""` grammar is `:ok`.

  ## Examples

      :ok = LlamaCppEx.Sampler.validate_grammar(model, grammar: ~S{root ::= "a"})
      {:error, :invalid_grammar} = LlamaCppEx.Sampler.validate_grammar(model, grammar: "root ::= nope")
  """
  @spec validate_grammar(Model.t(), keyword()) :: :ok | {:error, :invalid_grammar}
  def validate_grammar(%Model{ref: ref}, opts) do
    case Keyword.get(opts, :grammar) do
      g when g in [nil, ""] ->
        :ok

      g ->
        with :ok <- Options.check(:grammar, g, :string),
             :ok <-
               Options.check(:grammar_root, Keyword.get(opts, :grammar_root) || "root", :string),
             :ok <- NIF.grammar_validate(ref, g, Keyword.get(opts, :grammar_root) || "root") do
          :ok
        else
          {:error, _} -> {:error, :invalid_grammar}
        end
    end
  end

  @doc """
  Creates a sampler.

  ## Options

    * `:seed` - RNG seed (0..2^64-1). Default: random.
    * `:temp` - temperature; `0.0` is greedy. Default 0.8.
    * `:top_k` - keep the k most likely tokens; 0 disables. Default 40.
    * `:top_p` - nucleus threshold; 1.0 disables. Default 0.95.
    * `:min_p` - drop tokens below `min_p × p(max)`; 0.0 disables. Default 0.05.
    * `:penalty_repeat` (1.0), `:penalty_freq` (0.0), `:penalty_present` (0.0) - over the
      last `:penalty_last_n` tokens.
    * `:grammar`, `:grammar_root` - a GBNF grammar (see `LlamaCppEx.Grammar`) and its start
      rule (default `"root"`). A grammar that does not compile returns
      `{:error, :invalid_grammar}`.
    * `:grammar_triggers` - strings; when given, the grammar waits for the first of them in
      the output (llama.cpp's lazy grammars): before it the model writes freely, from its
      first byte on the grammar constrains the rest. Default `[]` (the grammar applies from
      the first token). Tool calls use it for `tool_choice: "auto"`.
    * `:penalty_last_n` - history the penalties see; 0 disables, -1 = all. Default 64.
    * `:min_keep` - fewest candidates top-p, min-p, typical and XTC may leave. Default 0.
    * `:typical_p` - locally typical sampling; 1.0 disables. Default 1.0.
    * `:top_n_sigma` - keep logits within n standard deviations of the best; ≤ 0 disables.
    * `:xtc_probability` (0.0), `:xtc_threshold` (0.1) - "exclude top choices".
    * `:dry_multiplier` (0.0 = off), `:dry_base` (1.75), `:dry_allowed_length` (2),
      `:dry_penalty_last_n` (-1), `:dry_sequence_breakers` (`["\\n", ":", "\\"", "*"]`) - DRY
      repetition penalty; a token whose text contains a breaker ends a repetition.
    * `:mirostat` (0, 1 or 2), `:mirostat_tau` (5.0), `:mirostat_eta` (0.1).
    * `:dynatemp_range` (0.0 = off), `:dynatemp_exponent` (1.0) - dynamic temperature.
    * `:logit_bias` - `%{token_id => bias}` or `[{token_id, bias}]`; use `:neg_infinity` (or
      `false`) to ban a token.
    * `:logprobs` - report the log-probability of each sampled token (from the raw logits,
      before any sampling stage). Default `false`.
    * `:top_logprobs` - with `:logprobs`, also report the most likely alternatives, up to
      `LlamaCppEx.Limits.engine().max_top_logprobs`.

  Numbers are checked here (`{:error, "invalid key: value"}` for a wrong type or a value out
  of range), the rest (a temperature that is not finite, a penalty that is not positive,
  token ids outside the vocabulary) by the engine.
  """
  @spec create(Model.t(), keyword()) :: {:ok, t()} | {:error, term()}
  def create(%Model{ref: mref} = model, opts \\ []) do
    Options.validate!(opts, all_keys(), "LlamaCppEx.Sampler.create/2")

    with {:ok, native} <- native_opts(opts) do
      case NIF.sampler_init(mref, native) do
        {:ok, ref} -> {:ok, %__MODULE__{ref: ref, model: model}}
        {:error, _} = error -> error
      end
    end
  end

  @doc false
  # The validated, complete option map the NIF takes.
  @spec native_opts(keyword()) :: {:ok, map()} | {:error, String.t()}
  def native_opts(opts) do
    with :ok <- Options.check_all(opts, specs()),
         {:ok, grammar} <- grammar(Keyword.get(opts, :grammar)),
         {:ok, bias, ban} <- logit_bias(Keyword.get(opts, :logit_bias, %{})) do
      d = defaults()
      top = Keyword.get(opts, :top_logprobs, 0)

      # every option the engine has a default for, floats as floats
      values =
        for {key, spec} <- @specs, Map.has_key?(d, key), into: %{} do
          value = Keyword.get(opts, key, Map.fetch!(d, key))
          {key, if(match?({:number, _, _}, spec), do: value * 1.0, else: value)}
        end

      {:ok,
       Map.merge(values, %{
         seed: Keyword.get(opts, :seed),
         logit_bias: bias,
         logit_ban: ban,
         logprobs: if(logprobs?(opts), do: top, else: nil),
         grammar: grammar,
         grammar_root: Keyword.get(opts, :grammar_root) || "root",
         grammar_triggers: Keyword.get(opts, :grammar_triggers, [])
       })}
    end
  end

  defp grammar(g) when g in [nil, ""], do: {:ok, nil}

  defp grammar(g) do
    case Options.check(:grammar, g, :string) do
      :ok -> {:ok, g}
      {:error, _} -> {:error, :invalid_grammar}
    end
  end

  @id {:int, 0, 4_294_967_295}

  defp logit_bias(v) when is_map(v) or is_list(v) do
    Enum.reduce_while(v, {:ok, [], []}, fn
      {id, ban}, {:ok, bias, bans} when ban in [:neg_infinity, false] ->
        case Options.check(:logit_bias, id, @id) do
          :ok -> {:cont, {:ok, bias, [id | bans]}}
          error -> {:halt, error}
        end

      {id, b}, {:ok, bias, bans} ->
        with :ok <- Options.check(:logit_bias, id, @id),
             :ok <- Options.check(:logit_bias, b, @float) do
          {:cont, {:ok, [{id, b * 1.0} | bias], bans}}
        else
          error -> {:halt, error}
        end

      other, _ ->
        {:halt, {:error, "invalid logit_bias: #{inspect(other)}"}}
    end)
    |> case do
      {:ok, bias, bans} -> {:ok, Enum.reverse(bias), Enum.reverse(bans)}
      error -> error
    end
  end

  defp logit_bias(other),
    do: {:error, "invalid logit_bias: #{inspect(other)}"}

  @doc """
  What the grammar cost this sampler. A greedy step first picks without the grammar and keeps
  the token when the grammar allows it (llama.cpp's shortcut); a sampled step with `top_k`
  checks the best candidates until `top_k` allowed ones are found. Both are exact and cost
  microseconds per checked token; only when they cannot decide is the full token mask
  computed. Returns `%{steps: n, masks: full_masks,
  step_mean_us: mean grammar time per step, mask_mean_us: float, mask_max_us: float}` (zeros
  without a grammar).
  """
  @spec grammar_stats(t()) :: %{
          steps: non_neg_integer(),
          masks: non_neg_integer(),
          step_mean_us: float(),
          mask_mean_us: float(),
          mask_max_us: float()
        }
  def grammar_stats(%__MODULE__{ref: ref}) do
    {steps, masks, mask_ns, max_ns, check_ns} = NIF.sampler_grammar_stats(ref)

    %{
      steps: steps,
      masks: masks,
      step_mean_us: if(steps > 0, do: (mask_ns + check_ns) / steps / 1000, else: 0.0),
      mask_mean_us: if(masks > 0, do: mask_ns / masks / 1000, else: 0.0),
      mask_max_us: max_ns / 1000
    }
  end

  @doc "Resets the RNG, the penalty history, Mirostat's state and the grammar."
  @spec reset(t()) :: :ok
  def reset(%__MODULE__{ref: ref}), do: NIF.sampler_reset(ref)

  @doc """
  Records `token` in the penalty history and advances the grammar past it. Raises
  `ArgumentError` for an id outside the vocabulary.
  """
  @spec accept(t(), non_neg_integer()) :: :ok
  def accept(%__MODULE__{ref: ref}, token) do
    with :ok <- Options.check(:token, token, @id),
         :ok <- NIF.sampler_accept(ref, token) do
      :ok
    else
      {:error, msg} -> raise ArgumentError, msg
    end
  end

  @doc """
  Samples (and accepts) a token from the logits of the last evaluated token of `ctx`.
  Raises `ArgumentError` when the context holds no logits.
  """
  @spec sample(t(), Context.t()) :: non_neg_integer()
  def sample(%__MODULE__{} = sampler, %Context{} = ctx), do: sample_at(sampler, ctx, -1)

  @doc "Like `sample/2` for entry `idx` of the last batch (-1 = last entry with logits)."
  @spec sample_at(t(), Context.t(), integer()) :: non_neg_integer()
  def sample_at(%__MODULE__{ref: ref}, %Context{ref: cref}, idx) do
    with :ok <- Options.check(:idx, idx, {:int, -1, 4_294_967_295}),
         {:ok, token} <- NIF.sampler_sample_at(ref, cref, idx) do
      token
    else
      {:error, msg} -> raise ArgumentError, "invalid_index: #{msg}"
    end
  end
end
