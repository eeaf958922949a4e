defmodule LlamaCppEx.Sampler do
  @moduledoc """
  A token sampler with llama.cpp's stage order and semantics:

  logit bias → grammar → penalties → DRY → top-n-σ → top-k → typical → top-p → min-p → XTC →
  temperature (dynamic with `:dynatemp_range`) → seeded draw. With `temp: 0` the token is the
  argmax after bias, grammar, penalties and DRY. `mirostat: 1 | 2` replaces the truncation
  stages with temperature → Mirostat, as llama.cpp's common sampler does.

  ## Example

      {:ok, sampler} = LlamaCppEx.Sampler.create(model, temp: 0.7, top_p: 0.9, seed: 42)
      {:ok, sampler} = LlamaCppEx.Sampler.create(model, grammar: ~S{root ::= "yes" | "no"})
  """

  alias LlamaCppEx.{Context, Model, NIF, Options}

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

  # Samplers beyond the contract's list, with llama.cpp's defaults.
  @extra_defaults [
    penalty_last_n: 64,
    min_keep: 0,
    typical_p: 1.0,
    top_n_sigma: -1.0,
    xtc_probability: 0.0,
    xtc_threshold: 0.1,
    dry_multiplier: 0.0,
    dry_base: 1.75,
    dry_allowed_length: 2,
    dry_penalty_last_n: -1,
    dry_sequence_breakers: ["\n", ":", "\"", "*"],
    mirostat: 0,
    mirostat_tau: 5.0,
    mirostat_eta: 0.1,
    dynatemp_range: 0.0,
    dynatemp_exponent: 1.0,
    logit_bias: %{}
  ]
  @extra_keys Keyword.keys(@extra_defaults)

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

      g when is_binary(g) ->
        case NIF.grammar_validate(ref, g, Keyword.get(opts, :grammar_root) || "root") do
          :ok -> :ok
          {:error, _} -> {:error, :invalid_grammar}
        end

      _ ->
        {:error, :invalid_grammar}
    end
  end

  @doc """
  Creates a sampler.

  ## Options

    * `:seed` - RNG seed. Default: random.
    * `:temp` - temperature; `0.0` is greedy. Default 0.8.
    * `:top_k` - keep the k most likely tokens; 0 disables. Default 40.
    * `:top_p` - nucleus threshold; 1.0 disables. Default 0.95.
    * `:min_p` - drop tokens below `min_p × p(max)`; 0.0 disables. Default 0.05.
    * `:penalty_repeat` (1.0), `:penalty_freq` (0.0), `:penalty_present` (0.0) - over the
      last 64 tokens.
    * `:grammar`, `:grammar_root` - a GBNF grammar (see `LlamaCppEx.Grammar`) and its start
      rule (default `"root"`). An invalid grammar returns `{:error, :invalid_grammar}`.
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
    * `:top_logprobs` - with `:logprobs`, also report the 0..20 most likely alternatives.
  """
  @spec create(Model.t(), keyword()) :: {:ok, t()} | {:error, term()}
  def create(%Model{ref: mref} = model, opts \\ []) do
    Options.validate!(opts, @keys ++ @logprob_keys ++ @extra_keys, "LlamaCppEx.Sampler.create/2")
    seed = Keyword.get_lazy(opts, :seed, fn -> :rand.uniform(1_000_000_000) end)

    with :ok <- check(:seed, seed, &(is_integer(&1) and &1 >= 0)),
         :ok <- check(:top_k, Keyword.get(opts, :top_k, 40), &is_integer/1),
         {:ok, logprobs} <- logprobs(opts),
         :ok <- check_numbers(opts),
         {:ok, extras} <- extras(opts) do
      case NIF.sampler_init(
             mref,
             seed,
             float(opts, :temp, 0.8),
             Keyword.get(opts, :top_k, 40),
             float(opts, :top_p, 0.95),
             float(opts, :min_p, 0.05),
             float(opts, :penalty_repeat, 1.0),
             float(opts, :penalty_freq, 0.0),
             float(opts, :penalty_present, 0.0),
             Keyword.get(opts, :grammar) || "",
             Keyword.get(opts, :grammar_root) || "root",
             logprobs,
             extras
           ) do
        {:ok, ref} -> {:ok, %__MODULE__{ref: ref, model: model}}
        {:error, _} = error -> error
      end
    end
  end

  @max_top_logprobs 20

  @extra_ints [:penalty_last_n, :min_keep, :dry_allowed_length, :dry_penalty_last_n]

  defp extras(opts) do
    Enum.reduce_while(@extra_defaults, {:ok, %{}}, fn {key, default}, {:ok, acc} ->
      case extra(key, Keyword.get(opts, key, default)) do
        {:ok, v} -> {:cont, {:ok, Map.put(acc, key, v)}}
        :error -> {:halt, {:error, "invalid #{key}: #{inspect(Keyword.get(opts, key))}"}}
      end
    end)
  end

  defp extra(:mirostat, v) when v in [0, 1, 2], do: {:ok, v}
  defp extra(:mirostat, _), do: :error
  defp extra(key, v) when key in @extra_ints and is_integer(v), do: {:ok, v}
  defp extra(key, _) when key in @extra_ints, do: :error

  defp extra(:dry_sequence_breakers, v) when is_list(v) do
    if Enum.all?(v, &is_binary/1), do: {:ok, v}, else: :error
  end

  defp extra(:dry_sequence_breakers, _), do: :error

  defp extra(:logit_bias, v) when is_map(v) or is_list(v) do
    Enum.reduce_while(v, {:ok, []}, fn
      {id, bias}, {:ok, acc} when is_integer(id) and is_number(bias) ->
        {:cont, {:ok, [{id, bias * 1.0} | acc]}}

      {id, ban}, {:ok, acc} when is_integer(id) and ban in [:neg_infinity, false] ->
        {:cont, {:ok, [{id, -1.0e30} | acc]}}

      _, _ ->
        {:halt, :error}
    end)
    |> case do
      {:ok, list} -> {:ok, Enum.reverse(list)}
      :error -> :error
    end
  end

  defp extra(:logit_bias, _), do: :error
  defp extra(_key, v) when is_number(v), do: {:ok, v * 1.0}
  defp extra(_key, _), do: :error

  defp logprobs(opts) do
    top = Keyword.get(opts, :top_logprobs, 0)

    cond do
      not (is_integer(top) and top >= 0 and top <= @max_top_logprobs) ->
        {:error,
         "top_logprobs must be an integer in 0..#{@max_top_logprobs}, got #{inspect(top)}"}

      Keyword.get(opts, :logprobs, false) == true or top > 0 ->
        {:ok, top}

      true ->
        {:ok, -1}
    end
  end

  @float_keys [:temp, :top_p, :min_p, :penalty_repeat, :penalty_freq, :penalty_present]

  defp check_numbers(opts) do
    Enum.reduce_while(@float_keys, :ok, fn key, :ok ->
      case Keyword.fetch(opts, key) do
        {:ok, v} when is_number(v) -> {:cont, :ok}
        {:ok, v} -> {:halt, {:error, "#{key} must be a number, got #{inspect(v)}"}}
        :error -> {:cont, :ok}
      end
    end)
  end

  defp check(key, value, pred) do
    if pred.(value), do: :ok, else: {:error, "invalid #{key}: #{inspect(value)}"}
  end

  defp float(opts, key, default), do: opts |> Keyword.get(key, default) |> Kernel.*(1.0)

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

  @doc "Records `token` in the penalty history and advances the grammar past it."
  @spec accept(t(), non_neg_integer()) :: :ok
  def accept(%__MODULE__{ref: ref}, token) when is_integer(token) do
    case NIF.sampler_accept(ref, token) do
      :ok -> :ok
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
    case NIF.sampler_sample_at(ref, cref, idx) do
      {:ok, token} -> token
      {:error, msg} -> raise ArgumentError, "invalid_index: #{msg}"
    end
  end
end
