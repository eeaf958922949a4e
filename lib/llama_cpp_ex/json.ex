defmodule LlamaCppEx.JSON do
  @moduledoc false
  # A small JSON encoder (values handed to the native layer) and decoder (checking
  # grammar-constrained output): Elixir 1.14 has no JSON module and this library takes no Hex
  # dependencies.

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

  # an object whose keys keep the order given (schemas whose property order matters)
  defp enc({:ordered, pairs}) when is_list(pairs) do
    [
      "{",
      Enum.map_intersperse(pairs, ",", fn {k, x} -> [string(to_string(k)), ":", enc(x)] end),
      "}"
    ]
  end

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

  @doc false
  @spec decode(String.t()) :: {:ok, term()} | {:error, String.t()}
  def decode(text) when is_binary(text) do
    case value(skip(text)) do
      {:ok, v, rest} ->
        if skip(rest) == "", do: {:ok, v}, else: {:error, "trailing data: #{inspect(rest)}"}

      {:error, _} = e ->
        e
    end
  end

  defp skip(<<c, rest::binary>>) when c in ~c[ \t\r\n], do: skip(rest)
  defp skip(rest), do: rest

  defp value("null" <> r), do: {:ok, nil, r}
  defp value("true" <> r), do: {:ok, true, r}
  defp value("false" <> r), do: {:ok, false, r}
  defp value("\"" <> r), do: str(r, [])
  defp value("{" <> r), do: obj(skip(r), %{}, true)
  defp value("[" <> r), do: arr(skip(r), [], true)

  defp value(<<c, _::binary>> = r) when c == ?- or c in ?0..?9 do
    case Regex.run(~r/\A-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/, r) do
      [num | groups] ->
        rest = binary_part(r, byte_size(num), byte_size(r) - byte_size(num))
        float? = Enum.any?(groups, &(&1 != "" and String.match?(&1, ~r/^[.eE]/)))
        {:ok, if(float?, do: to_float(num), else: String.to_integer(num)), rest}

      nil ->
        {:error, "bad number"}
    end
  end

  defp value(r), do: {:error, "unexpected #{inspect(String.slice(r, 0, 10))}"}

  defp to_float(num) do
    num = if String.contains?(num, "."), do: num, else: String.replace(num, ~r/[eE]/, ".0e")
    String.to_float(num)
  end

  defp str("\"" <> r, acc), do: {:ok, acc |> Enum.reverse() |> IO.iodata_to_binary(), r}

  defp str("\\u" <> <<h::binary-size(4), r::binary>>, acc) do
    case Integer.parse(h, 16) do
      {hi, ""} when hi in 0xD800..0xDBFF ->
        with "\\u" <> <<l::binary-size(4), r2::binary>> <- r,
             {lo, ""} when lo in 0xDC00..0xDFFF <- Integer.parse(l, 16) do
          str(r2, [<<0x10000 + (hi - 0xD800) * 0x400 + (lo - 0xDC00)::utf8>> | acc])
        else
          _ -> {:error, "bad surrogate pair"}
        end

      {cp, ""} ->
        str(r, [<<cp::utf8>> | acc])

      _ ->
        {:error, "bad \\u escape"}
    end
  end

  defp str("\\" <> <<e, r::binary>>, acc) do
    case e do
      ?" -> str(r, ["\"" | acc])
      ?\\ -> str(r, ["\\" | acc])
      ?/ -> str(r, ["/" | acc])
      ?b -> str(r, ["\b" | acc])
      ?f -> str(r, ["\f" | acc])
      ?n -> str(r, ["\n" | acc])
      ?r -> str(r, ["\r" | acc])
      ?t -> str(r, ["\t" | acc])
      _ -> {:error, "bad escape"}
    end
  end

  defp str(<<c, _::binary>>, _acc) when c < 0x20, do: {:error, "control character in string"}
  defp str(<<c::utf8, r::binary>>, acc), do: str(r, [<<c::utf8>> | acc])
  defp str(_, _acc), do: {:error, "unterminated string"}

  defp obj("}" <> r, acc, true), do: {:ok, acc, r}

  defp obj("\"" <> r, acc, _first) do
    with {:ok, k, r} <- str(r, []),
         ":" <> r <- skip(r),
         {:ok, v, r} <- value(skip(r)) do
      case skip(r) do
        "," <> r -> obj(skip(r), Map.put(acc, k, v), false)
        "}" <> r -> {:ok, Map.put(acc, k, v), r}
        _ -> {:error, "expected , or } in object"}
      end
    else
      {:error, _} = e -> e
      _ -> {:error, "expected : in object"}
    end
  end

  defp obj(_, _acc, _first), do: {:error, "expected a key in object"}

  defp arr("]" <> r, acc, true), do: {:ok, Enum.reverse(acc), r}

  defp arr(r, acc, _first) do
    with {:ok, v, r} <- value(r) do
      case skip(r) do
        "," <> r -> arr(skip(r), [v | acc], false)
        "]" <> r -> {:ok, Enum.reverse([v | acc]), r}
        _ -> {:error, "expected , or ] in array"}
      end
    end
  end
end
