defmodule LlamaCppEx.JSON do
  @moduledoc false
  # A small JSON encoder for values handed to the native layer (Elixir 1.14 has no JSON
  # module and this library takes no Hex dependencies).

  @spec encode!(term()) :: String.t()
  def encode!(value), do: value |> enc() |> IO.iodata_to_binary()

  defp enc(nil), do: "null"
  defp enc(true), do: "true"
  defp enc(false), do: "false"
  defp enc(v) when is_integer(v), do: Integer.to_string(v)
  defp enc(v) when is_float(v), do: :erlang.float_to_binary(v, [:short])
  defp enc(v) when is_atom(v), do: string(Atom.to_string(v))
  defp enc(v) when is_binary(v), do: string(v)
  defp enc(v) when is_list(v), do: ["[", Enum.map_intersperse(v, ",", &enc/1), "]"]

  defp enc(%{} = v) do
    pairs = Enum.map_intersperse(v, ",", fn {k, x} -> [string(to_string(k)), ":", enc(x)] end)
    ["{", pairs, "}"]
  end

  defp enc(other), do: raise(ArgumentError, "cannot encode #{inspect(other)} as JSON")

  defp string(s) do
    unless String.valid?(s), do: raise(ArgumentError, "invalid UTF-8 in #{inspect(s)}")
    [?", escape(s, []), ?"]
  end

  defp escape(<<>>, acc), do: Enum.reverse(acc)
  defp escape(<<?", rest::binary>>, acc), do: escape(rest, ["\\\"" | acc])
  defp escape(<<?\\, rest::binary>>, acc), do: escape(rest, ["\\\\" | acc])
  defp escape(<<?\n, rest::binary>>, acc), do: escape(rest, ["\\n" | acc])
  defp escape(<<?\r, rest::binary>>, acc), do: escape(rest, ["\\r" | acc])
  defp escape(<<?\t, rest::binary>>, acc), do: escape(rest, ["\\t" | acc])

  defp escape(<<c, rest::binary>>, acc) when c < 0x20,
    do: escape(rest, [:io_lib.format("\\u~4.16.0b", [c]) | acc])

  defp escape(<<c::utf8, rest::binary>>, acc), do: escape(rest, [<<c::utf8>> | acc])
end
