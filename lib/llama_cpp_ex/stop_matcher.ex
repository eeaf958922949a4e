defmodule LlamaCppEx.StopMatcher do
  @moduledoc false
  # Finds stop strings in streamed text across chunk boundaries. Text that could still turn
  # into a stop string is held back; the matched stop string and everything after it are
  # never emitted.

  @type t :: %{stops: [String.t()], held: String.t()}

  @spec new([String.t()] | String.t() | nil) :: t() | nil
  def new(nil), do: nil
  def new([]), do: nil
  def new(stop) when is_binary(stop), do: new([stop])

  def new(stops) when is_list(stops) do
    stops = Enum.reject(stops, &(&1 == ""))
    if stops == [], do: nil, else: %{stops: stops, held: ""}
  end

  @doc "Validates the `:stop` option value."
  @spec valid?(term()) :: boolean()
  def valid?(nil), do: true
  def valid?(s) when is_binary(s), do: true
  def valid?(l) when is_list(l), do: Enum.all?(l, &is_binary/1)
  def valid?(_), do: false

  @doc """
  Feeds text; returns `{:cont, emit, matcher}` or `{:stop, emit}` when a stop string matched
  (`emit` is the text before it).
  """
  @spec push(t(), String.t()) :: {:cont, String.t(), t()} | {:stop, String.t()}
  def push(%{stops: stops, held: held} = m, text) do
    data = held <> text

    case earliest(data, stops) do
      nil ->
        keep = longest_partial(data, stops)
        emit_size = byte_size(data) - keep
        {:cont, binary_part(data, 0, emit_size), %{m | held: binary_part(data, emit_size, keep)}}

      at ->
        {:stop, binary_part(data, 0, at)}
    end
  end

  @doc "Text still held back (emitted when generation ends without a match)."
  @spec flush(t()) :: String.t()
  def flush(%{held: held}), do: held

  defp earliest(data, stops) do
    stops
    |> Enum.flat_map(fn s ->
      case :binary.match(data, s) do
        {at, _} -> [at]
        :nomatch -> []
      end
    end)
    |> Enum.min(fn -> nil end)
  end

  @doc false
  # Length of the longest suffix of `data` that is a proper prefix of one of `tags`.
  @spec longest_partial(binary(), [binary()]) :: non_neg_integer()
  def longest_partial(data, stops) do
    stops
    |> Enum.map(fn s ->
      max = min(byte_size(data), byte_size(s) - 1)

      Enum.find(max..1//-1, 0, fn n ->
        binary_part(data, byte_size(data) - n, n) == binary_part(s, 0, n)
      end)
    end)
    |> Enum.max(fn -> 0 end)
  end
end
