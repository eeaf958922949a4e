defmodule LlamaCppEx.Schema do
  @moduledoc """
  JSON Schemas from Ecto schemas, for `:json_schema` constrained generation.

  Needs the optional `:ecto` dependency; LlamaCppEx compiles and runs without it.

      defmodule Person do
        use Ecto.Schema

        embedded_schema do
          field :name, :string
          field :age, :integer
        end
      end

      schema = LlamaCppEx.Schema.to_json_schema(Person)
      {:ok, json} = LlamaCppEx.generate(model, "A person as JSON:", json_schema: schema)

  Every included field is required, in declaration order. `:id`, `:inserted_at`,
  `:updated_at` and virtual fields are left out. Types map as: string/binary/binary_id →
  string; integer/id → integer; float/decimal → number; boolean → boolean; map and
  `{:map, _}` → object; `{:array, t}` → array; date, time and (naive/utc) datetimes →
  string with format "date", "time" or "date-time"; anything else → string. `embeds_one`
  becomes a nested object, `embeds_many` an array of them.
  """

  @excluded [:id, :inserted_at, :updated_at]

  @doc """
  The JSON Schema of an Ecto schema module. Raises `ArgumentError` when `module` is not an
  Ecto schema and `RuntimeError` when Ecto is not available.
  """
  @spec to_json_schema(module()) :: map()
  def to_json_schema(module) when is_atom(module) do
    unless Code.ensure_loaded?(Ecto.Schema) do
      raise RuntimeError,
            "LlamaCppEx.Schema.to_json_schema/1 needs the optional :ecto dependency"
    end

    from_reflection(module)
  end

  @doc false
  # The mapping over Ecto's reflection functions (`__schema__/1,2`).
  @spec from_reflection(module()) :: map()
  def from_reflection(module) do
    unless Code.ensure_loaded?(module) and function_exported?(module, :__schema__, 1) do
      raise ArgumentError, "#{inspect(module)} is not an Ecto schema"
    end

    embeds = module.__schema__(:embeds)
    fields = Enum.reject(module.__schema__(:fields), &(&1 in @excluded))

    properties =
      Map.new(fields, fn field ->
        schema =
          if field in embeds,
            do: embed(module.__schema__(:embed, field)),
            else: type(module.__schema__(:type, field))

        {Atom.to_string(field), schema}
      end)

    %{
      "type" => "object",
      "properties" => properties,
      "required" => Enum.map(fields, &Atom.to_string/1)
    }
  end

  defp embed(%{cardinality: :one, related: related}), do: from_reflection(related)

  defp embed(%{cardinality: :many, related: related}),
    do: %{"type" => "array", "items" => from_reflection(related)}

  defp type(t) when t in [:string, :binary, :binary_id], do: %{"type" => "string"}
  defp type(t) when t in [:integer, :id], do: %{"type" => "integer"}
  defp type(t) when t in [:float, :decimal], do: %{"type" => "number"}
  defp type(:boolean), do: %{"type" => "boolean"}
  defp type(:map), do: %{"type" => "object"}
  defp type({:map, _}), do: %{"type" => "object"}
  defp type({:array, t}), do: %{"type" => "array", "items" => type(t)}
  defp type(:date), do: %{"type" => "string", "format" => "date"}
  defp type(t) when t in [:time, :time_usec], do: %{"type" => "string", "format" => "time"}

  defp type(t)
       when t in [:utc_datetime, :utc_datetime_usec, :naive_datetime, :naive_datetime_usec],
       do: %{"type" => "string", "format" => "date-time"}

  defp type(_other), do: %{"type" => "string"}
end
