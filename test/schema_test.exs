defmodule LlamaCppEx.SchemaTest do
  use ExUnit.Case, async: true

  alias LlamaCppEx.{Grammar, Schema}

  # Ecto is not a dependency (no Hex here); these modules answer Ecto's reflection calls the
  # way `use Ecto.Schema` generates them, so the mapping itself is exercised.
  defmodule Address do
    def __schema__(:fields), do: [:id, :street, :zip]
    def __schema__(:embeds), do: []
    def __schema__(:type, :street), do: :string
    def __schema__(:type, :zip), do: :integer
  end

  defmodule Person do
    def __schema__(:fields),
      do: [
        :id,
        :name,
        :age,
        :score,
        :admin,
        :meta,
        :tags,
        :born,
        :wakes,
        :seen,
        :other,
        :address,
        :past,
        :inserted_at,
        :updated_at
      ]

    def __schema__(:embeds), do: [:address, :past]
    def __schema__(:embed, :address), do: %{cardinality: :one, related: Address}
    def __schema__(:embed, :past), do: %{cardinality: :many, related: Address}
    def __schema__(:type, :name), do: :string
    def __schema__(:type, :age), do: :integer
    def __schema__(:type, :score), do: :decimal
    def __schema__(:type, :admin), do: :boolean
    def __schema__(:type, :meta), do: {:map, :string}
    def __schema__(:type, :tags), do: {:array, :string}
    def __schema__(:type, :born), do: :date
    def __schema__(:type, :wakes), do: :time
    def __schema__(:type, :seen), do: :utc_datetime_usec
    def __schema__(:type, :other), do: Some.Custom.Type
  end

  test "maps fields, embeds and exclusions" do
    s = Schema.from_reflection(Person)
    assert s["type"] == "object"

    assert s["required"] ==
             ~w(name age score admin meta tags born wakes seen other address past)

    p = s["properties"]
    assert p["name"] == %{"type" => "string"}
    assert p["age"] == %{"type" => "integer"}
    assert p["score"] == %{"type" => "number"}
    assert p["admin"] == %{"type" => "boolean"}
    assert p["meta"] == %{"type" => "object"}
    assert p["tags"] == %{"type" => "array", "items" => %{"type" => "string"}}
    assert p["born"] == %{"type" => "string", "format" => "date"}
    assert p["wakes"] == %{"type" => "string", "format" => "time"}
    assert p["seen"] == %{"type" => "string", "format" => "date-time"}
    assert p["other"] == %{"type" => "string"}
    assert p["address"]["required"] == ["street", "zip"]
    assert p["past"]["type"] == "array" and p["past"]["items"]["type"] == "object"
    refute Map.has_key?(p, "id") or Map.has_key?(p, "inserted_at")

    assert {:ok, _gbnf} = Grammar.from_json_schema(s)
  end

  test "errors" do
    assert_raise ArgumentError, ~r/not an Ecto schema/, fn -> Schema.from_reflection(String) end

    if Code.ensure_loaded?(Ecto.Schema) do
      assert_raise ArgumentError, fn -> Schema.to_json_schema(String) end
    else
      assert_raise RuntimeError, ~r/:ecto/, fn -> Schema.to_json_schema(Person) end
    end
  end
end
