defmodule LlamaCppEx.Grammar do
  @moduledoc """
  Grammars for constrained generation.

  Every generation function accepts `:grammar` (GBNF text, llama.cpp's syntax) with
  `:grammar_root` (default `"root"`), or `:json_schema` (a map, or JSON text). Constraints are
  enforced by [llguidance](https://github.com/guidance-ai/llguidance): GBNF is translated by
  LlamaCppEx's own front end, JSON Schemas are compiled by llguidance itself (numeric ranges,
  patterns, formats, `$ref`, `anyOf`/`oneOf`, `additionalProperties` included). Text that
  starts with `%llguidance` is llguidance's Lark dialect and is passed through unchanged, as
  in llama.cpp.

  GBNF covers rules, alternation, string literals with escapes (`\\n`, `\\xHH`, `\\uHHHH`,
  ...), character classes with ranges and negation, `.`, groups, `*`, `+`, `?`, `{m}`,
  `{m,}`, `{m,n}` and `#` comments. Limits: 1 MiB of text and parenthesis nesting depth 64.

  ## Examples

      {:ok, text} = LlamaCppEx.generate(model, "Pick a color:", grammar: ~S{root ::= "red" | "blue"})

      schema = %{"type" => "object", "properties" => %{"name" => %{"type" => "string"}},
                 "required" => ["name"]}
      {:ok, json} = LlamaCppEx.generate(model, "Describe a person as JSON.", json_schema: schema)

      {:ok, gbnf} = LlamaCppEx.Grammar.from_json_schema(schema)

  JSON output is laid out compactly with `", "` and `": "` separators (a small model allowed
  arbitrary whitespace can loop on it); set llguidance's `"x-guidance"` key in the schema to
  change that. For the same reason each run of digits in a number (its integer part,
  fraction, exponent) stops at 16 digits, llama.cpp's bound, unless the schema needs more: a
  model that keeps choosing `0` after `1.` still finishes its JSON. The bound applies where
  the whole output is the JSON value (`:json_schema`), not to JSON inside tool-call markup.
  """

  alias LlamaCppEx.{JSON, Model, NIF}

  @max_bytes 1_048_576

  @doc """
  Converts a JSON Schema (a map) into GBNF text that defines a `root` rule.

  Returns `{:error, reason}` with a message containing "Unrecognized schema" for unknown
  types, "Error resolving ref" for a `$ref` that does not resolve, "schema nested too deeply"
  past 64 levels and "schema too large" over 1 MiB of JSON.

  ## Examples

      iex> {:ok, gbnf} = LlamaCppEx.Grammar.from_json_schema(%{"type" => "boolean"})
      iex> gbnf =~ "root ::="
      true
  """
  @spec from_json_schema(map()) :: {:ok, String.t()} | {:error, String.t()}
  def from_json_schema(schema), do: convert(schema, :gbnf)

  @doc """
  Like `from_json_schema/1`, raising `ArgumentError`
  ("failed to convert JSON schema to grammar: <reason>") on failure.
  """
  @spec from_json_schema!(map()) :: String.t()
  def from_json_schema!(schema), do: bang(from_json_schema(schema))

  @doc false
  # The grammar text generation uses for `:json_schema`: llguidance compiles the schema itself
  # (exact numeric ranges, patterns and formats); errors are those of `from_json_schema/1`.
  @spec json_schema_constraint!(map() | String.t()) :: String.t()
  def json_schema_constraint!(schema), do: bang(convert(schema, :llguidance))

  @doc false
  # The `%json {...}` term of `json_schema_constraint!/1`, to embed in a larger Lark grammar
  # (tool calls wrap schema-constrained JSON in the model's markup).
  @spec json_schema_lark!(map()) :: String.t()
  def json_schema_lark!(schema) do
    "%llguidance {}\nstart: " <> rest = json_schema_constraint!(schema)
    String.trim_trailing(rest)
  end

  @doc """
  Checks a grammar against a model's vocabulary: `:ok` or `{:error, message}` (the reason,
  unlike `LlamaCppEx.Sampler.validate_grammar/2` which answers with the contract's
  `{:error, :invalid_grammar}`).
  """
  @spec check(Model.t(), String.t(), String.t()) :: :ok | {:error, String.t()}
  def check(%Model{ref: ref}, grammar, root \\ "root") when is_binary(grammar) do
    NIF.grammar_validate(ref, grammar, root)
  end

  defp bang({:ok, text}), do: text

  defp bang({:error, reason}),
    do: raise(ArgumentError, "failed to convert JSON schema to grammar: #{reason}")

  defp convert(schema, mode) do
    with {:ok, json} <- encode(schema) do
      if byte_size(json) > @max_bytes,
        do: {:error, "schema too large"},
        else: NIF.grammar_from_json_schema(json, mode)
    end
  end

  defp encode(schema) when is_map(schema) do
    {:ok, JSON.encode!(schema)}
  rescue
    e in ArgumentError -> {:error, "Unrecognized schema: #{Exception.message(e)}"}
  end

  defp encode(schema) when is_binary(schema), do: {:ok, schema}

  defp encode(other),
    do: {:error, "Unrecognized schema: expected a map, got #{inspect(other)}"}
end
