defmodule LlamaCppEx.Options do
  @moduledoc """
  Option validation and timeout defaults shared by every public entry point.

  Unknown keys raise `ArgumentError` naming the key, with a "did you mean" hint when a known
  key is close (Jaro distance ≥ 0.78); the known keys follow on a line of their own:

      iex> LlamaCppEx.Options.validate!([temp: 0.1], [:temp, :top_k], "demo")
      [temp: 0.1]

      iex> LlamaCppEx.Options.validate!([temperature: 0.1], [:temp, :top_k], "demo")
      ** (ArgumentError) demo: unknown option: :temperature (did you mean :temp?)
      Known options: :temp, :top_k

  Values are checked by the module that owns them (`LlamaCppEx.Sampler`,
  `LlamaCppEx.Context`, ...) before they reach native code: a value of the wrong type or out
  of range is `{:error, "invalid key: value"}` (the accepted ranges are in each function's
  documentation), never a crash.

      iex> LlamaCppEx.Options.check(:top_k, 40, {:int, 0, 2_147_483_647})
      :ok

      iex> LlamaCppEx.Options.check(:top_k, 2 ** 64, {:int, 0, 2_147_483_647})
      {:error, "invalid top_k: 18446744073709551616"}

      iex> LlamaCppEx.Options.check(:temp, 2 ** 200, {:number, -1.0e30, 1.0e30})
      {:error, "invalid temp: an integer of 61 digits"}
  """

  @blocking_timeout 60_000
  @stream_timeout 30_000
  @suggestion_threshold 0.78

  @typedoc """
  What `check/3` accepts: integers or numbers within bounds (inclusive), booleans,
  binaries that are valid UTF-8, one of a list of values, or a list of one spec.
  """
  @type spec ::
          {:int, integer(), integer()}
          | {:number, number(), number()}
          | :boolean
          | :string
          | {:in, [term()]}
          | {:list, spec()}

  @doc "Default timeout of blocking calls (ms)."
  @spec blocking_timeout() :: pos_integer()
  def blocking_timeout, do: @blocking_timeout

  @doc "Default per-chunk timeout of streams (ms)."
  @spec stream_timeout() :: pos_integer()
  def stream_timeout, do: @stream_timeout

  @doc """
  The `:timeout` in `opts` (the first one wins; `:infinity` and `nil` pass through), else the
  default for `mode`.
  """
  @spec timeout(keyword(), :blocking | :stream) :: timeout() | nil
  def timeout(opts, mode) when mode in [:blocking, :stream] do
    case Keyword.fetch(opts, :timeout) do
      {:ok, t} -> t
      :error -> if mode == :blocking, do: @blocking_timeout, else: @stream_timeout
    end
  end

  @doc """
  Returns `opts` unchanged when every key is in `known`, else raises `ArgumentError`.
  """
  @spec validate!(keyword(), [atom()], String.t()) :: keyword()
  def validate!(opts, known, label) do
    unless is_list(opts) and Enum.all?(opts, &match?({k, _} when is_atom(k), &1)) do
      raise ArgumentError, "#{label}: options must be a keyword list, got: #{inspect(opts)}"
    end

    unknown = opts |> Keyword.keys() |> Enum.uniq() |> Enum.reject(&(&1 in known))

    case unknown do
      [] ->
        opts

      keys ->
        noun = if length(keys) == 1, do: "unknown option:", else: "unknown options:"
        listed = Enum.map_join(keys, ", ", &describe(&1, known))
        known_list = known |> Enum.uniq() |> Enum.sort() |> Enum.map_join(", ", &inspect/1)
        raise ArgumentError, "#{label}: #{noun} #{listed}\nKnown options: #{known_list}"
    end
  end

  defp describe(key, known) do
    name = Atom.to_string(key)

    best =
      known
      |> Enum.map(&{&1, String.jaro_distance(name, Atom.to_string(&1))})
      |> Enum.max_by(&elem(&1, 1), fn -> {nil, 0.0} end)

    case best do
      {candidate, score} when score >= @suggestion_threshold ->
        "#{inspect(key)} (did you mean #{inspect(candidate)}?)"

      _ ->
        inspect(key)
    end
  end

  @doc """
  `:ok` when `value` satisfies `spec`, else `{:error, "invalid key: value"}`.
  """
  @spec check(atom(), term(), spec()) :: :ok | {:error, String.t()}
  def check(key, value, spec) do
    if valid?(value, spec), do: :ok, else: {:error, "invalid #{key}: #{shown(value)}"}
  end

  # a huge integer by its size, anything else inspected briefly
  defp shown(v) when is_integer(v) and abs(v) > 1_000_000_000_000_000_000_000_000_000_000,
    do: "an integer of #{v |> abs() |> Integer.to_string() |> byte_size()} digits"

  defp shown(v), do: inspect(v, limit: 10, printable_limit: 80)

  @doc """
  Checks every `{key, spec}` whose key is present in `opts`; the first failure.
  """
  @spec check_all(keyword(), [{atom(), spec()}]) :: :ok | {:error, String.t()}
  def check_all(opts, specs) do
    Enum.reduce_while(specs, :ok, fn {key, spec}, :ok ->
      case Keyword.fetch(opts, key) do
        {:ok, value} ->
          case check(key, value, spec) do
            :ok -> {:cont, :ok}
            error -> {:halt, error}
          end

        :error ->
          {:cont, :ok}
      end
    end)
  end

  defp valid?(v, {:int, lo, hi}), do: is_integer(v) and v >= lo and v <= hi
  defp valid?(v, {:number, lo, hi}), do: is_number(v) and v >= lo and v <= hi
  defp valid?(v, :boolean), do: is_boolean(v)
  defp valid?(v, :string), do: is_binary(v) and String.valid?(v)
  defp valid?(v, {:in, values}), do: v in values
  defp valid?(v, {:list, spec}), do: is_list(v) and Enum.all?(v, &valid?(&1, spec))

  @doc """
  A `:speculative` option resolved to `nil` (off) or `%{mode:, n_draft:, draft_model:}`,
  raising `ArgumentError` for a malformed one: `mode: :prompt_lookup` (default) or `:draft`;
  `n_draft: 1..64` (default 8 for prompt lookup, 4 for a draft model); `draft_model:` a
  `LlamaCppEx.Model` or a GGUF path, only with `mode: :draft` (required on a model route; a
  Server uses its own). Shared by the model route and `LlamaCppEx.Server`.
  """
  @spec speculative!(term()) ::
          %{
            mode: :prompt_lookup | :draft,
            n_draft: pos_integer(),
            draft_model: LlamaCppEx.Model.t() | String.t() | nil
          }
          | nil
  def speculative!(nil), do: nil
  def speculative!(false), do: nil

  def speculative!(opts) when is_list(opts) do
    opts = Keyword.validate!(opts, mode: :prompt_lookup, n_draft: nil, draft_model: nil)
    mode = opts[:mode]

    unless mode in [:prompt_lookup, :draft] do
      raise ArgumentError,
            "unknown speculative mode #{inspect(mode)}, expected :prompt_lookup or :draft"
    end

    case {mode, opts[:draft_model]} do
      {_, nil} ->
        :ok

      {:draft, %LlamaCppEx.Model{}} ->
        :ok

      {:draft, path} when is_binary(path) ->
        :ok

      {:draft, other} ->
        raise ArgumentError,
              "speculative :draft_model must be a LlamaCppEx.Model or a path, got #{inspect(other)}"

      {:prompt_lookup, _} ->
        raise ArgumentError, "speculative :draft_model is only used with mode: :draft"
    end

    n_draft =
      case opts[:n_draft] || if(mode == :draft, do: 4, else: 8) do
        n when is_integer(n) and n in 1..64 ->
          n

        n ->
          raise ArgumentError,
                "speculative :n_draft must be an integer in 1..64, got #{inspect(n)}"
      end

    %{mode: mode, n_draft: n_draft, draft_model: opts[:draft_model]}
  end

  def speculative!(other),
    do: raise(ArgumentError, "invalid :speculative #{inspect(other)}, expected a keyword list")
end
