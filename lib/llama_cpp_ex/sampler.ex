defmodule LlamaCppEx.Sampler do
  @moduledoc """
  A token sampler with llama.cpp's stage order: penalties (last 64 tokens, only when not at
  their defaults) → top-k → top-p → min-p → temperature and a seeded draw, or greedy when
  `temp` is 0.

  ## Example

      {:ok, sampler} = LlamaCppEx.Sampler.create(model, temp: 0.7, top_p: 0.9, seed: 42)
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

  @doc "Sampling option keys."
  @spec option_keys() :: [atom()]
  def option_keys, do: @keys

  @doc "Log-probability reporting keys (accepted by `create/2` and every generation route)."
  @spec logprob_keys() :: [atom()]
  def logprob_keys, do: @logprob_keys

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
    * `:grammar`, `:grammar_root` - GBNF constraint (not yet available: a non-empty grammar
      returns an error).
    * `:logprobs` - report the log-probability of each sampled token (from the raw logits,
      before any sampling stage). Default `false`.
    * `:top_logprobs` - with `:logprobs`, also report the 0..20 most likely alternatives.
  """
  @spec create(Model.t(), keyword()) :: {:ok, t()} | {:error, term()}
  def create(%Model{ref: mref} = model, opts \\ []) do
    Options.validate!(opts, @keys ++ @logprob_keys, "LlamaCppEx.Sampler.create/2")
    seed = Keyword.get_lazy(opts, :seed, fn -> :rand.uniform(1_000_000_000) end)

    with :ok <- check(:seed, seed, &(is_integer(&1) and &1 >= 0)),
         :ok <- check(:top_k, Keyword.get(opts, :top_k, 40), &is_integer/1),
         {:ok, logprobs} <- logprobs(opts),
         :ok <- check_numbers(opts) do
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
             logprobs
           ) do
        {:ok, ref} -> {:ok, %__MODULE__{ref: ref, model: model}}
        {:error, _} = error -> error
      end
    end
  end

  @max_top_logprobs 20

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

  @doc "Resets the RNG and the penalty history."
  @spec reset(t()) :: :ok
  def reset(%__MODULE__{ref: ref}), do: NIF.sampler_reset(ref)

  @doc "Records `token` in the penalty history."
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
