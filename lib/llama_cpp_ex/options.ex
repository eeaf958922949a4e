defmodule LlamaCppEx.Options do
  @moduledoc """
  Option validation and timeout defaults shared by every public entry point.

  Unknown keys raise `ArgumentError` naming the key, with a "did you mean" hint when a known
  key is close (Jaro distance ≥ 0.78):

      iex> LlamaCppEx.Options.validate!([temp: 0.1], [:temp, :top_k], "demo")
      [temp: 0.1]

      iex> LlamaCppEx.Options.validate!([temperature: 0.1], [:temp, :top_k], "demo")
      ** (ArgumentError) demo: unknown option: :temperature (did you mean :temp?). Known options: :temp, :top_k
  """

  @blocking_timeout 60_000
  @stream_timeout 30_000
  @suggestion_threshold 0.78

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
        known_list = known |> Enum.sort() |> Enum.map_join(", ", &inspect/1)
        raise ArgumentError, "#{label}: #{noun} #{listed}. Known options: #{known_list}"
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
end
