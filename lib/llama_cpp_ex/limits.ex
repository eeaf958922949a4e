defmodule LlamaCppEx.Limits do
  @moduledoc """
  Bounds on inputs whose cost grows with their size or shape, so that no request and no
  model file can exhaust the node's memory, stack or time.

  | limit | default | bounds |
  |---|---:|---|
  | `:grammar_bytes` | 1 MiB | GBNF, Lark or JSON Schema text |
  | `:grammar_rules` | 10 000 | rules of a GBNF grammar |
  | `:grammar_nesting` | 64 | nesting of groups and repetitions; of subschemas |
  | `:schema_properties` | 1024 | properties of one JSON Schema object |
  | `:schema_optional_properties` | 256 | optional properties of one object |
  | `:schema_nodes` | 20 000 | subschemas of a JSON Schema |
  | `:template_fuel` | 4 000 000 | work and memory of one chat template render (about one per instruction and per 64 bytes of data) |
  | `:template_output_bytes` | 16 MiB | one rendered chat prompt |
  | `:template_value_depth` | 128 | nesting of a value a template prints or serialises |

  A request over a limit fails with `{:error, reason}` naming it; nothing is evaluated. Set
  them in your configuration (read when the application starts):

      config :llama_cpp_ex, limits: [grammar_bytes: 4_194_304, template_fuel: 10_000_000]

  or at run time with `put/1`. Each limit has a hard ceiling (the deepest input it allows
  must fit the stack that compiles grammars); `put/1` refuses values above it.

  Other bounds are options of their own: a prompt may not exceed the model's training
  context (or an explicit `:n_ctx`), `:n_threads` may not exceed twice the machine's cores,
  and a chat template renders in a separate OS process under a 2 GiB address-space limit and
  a 10 s deadline (see `LlamaCppEx.Chat`).
  """

  alias LlamaCppEx.NIF

  @type t :: %{
          grammar_bytes: pos_integer(),
          grammar_rules: pos_integer(),
          grammar_nesting: pos_integer(),
          schema_properties: pos_integer(),
          schema_optional_properties: pos_integer(),
          schema_nodes: pos_integer(),
          template_fuel: pos_integer(),
          template_output_bytes: pos_integer(),
          template_value_depth: pos_integer()
        }

  @typedoc "What the engine itself bounds and defaults; see `engine/0`."
  @type engine :: %{
          max_context_tokens: pos_integer(),
          max_sequences: pos_integer(),
          max_threads: pos_integer(),
          max_top_logprobs: pos_integer(),
          default_context_tokens: pos_integer(),
          default_ubatch: pos_integer()
        }

  @doc """
  The bounds and defaults the engine enforces, read from it once: the largest `:n_ctx` (and
  so the largest `:max_tokens`), the most sequences of a context, the most threads (twice
  the machine's cores), the most alternatives `:top_logprobs` reports, and the default
  `:n_ctx` and `:n_ubatch`. Options are checked against these values; they are written down
  nowhere else.

      iex> LlamaCppEx.Limits.engine().max_top_logprobs
      20
  """
  @spec engine() :: engine()
  def engine do
    case :persistent_term.get({__MODULE__, :engine}, nil) do
      nil ->
        limits = NIF.engine_limits()
        :persistent_term.put({__MODULE__, :engine}, limits)
        limits

      limits ->
        limits
    end
  end

  @doc false
  # The largest context, for `{:int, 1, max_context()}` option checks.
  @spec max_context() :: pos_integer()
  def max_context, do: engine().max_context_tokens

  @doc """
  The limits in force.

      iex> LlamaCppEx.Limits.get().grammar_nesting
      64
  """
  @spec get() :: t()
  def get, do: NIF.limits_get()

  @doc """
  Changes some limits (a keyword list or map of the keys of `get/0`); the others keep their
  values. `{:error, reason}` for an unknown key or a value that is not a positive integer
  within its ceiling.
  """
  @spec put(keyword() | map()) :: :ok | {:error, String.t()}
  def put(changes) do
    current = get()

    case Enum.find(changes, fn {k, _} -> not Map.has_key?(current, k) end) do
      {key, _} ->
        {:error,
         "unknown limit #{inspect(key)} (known: #{current |> Map.keys() |> Enum.sort() |> Enum.map_join(", ", &inspect/1)})"}

      nil ->
        merged = Map.merge(current, Map.new(changes))

        if Enum.all?(merged, fn {_, v} -> is_integer(v) and v > 0 and v < 2 ** 63 end),
          do: NIF.limits_set(merged),
          else: {:error, "limits must be positive integers, got #{inspect(Map.new(changes))}"}
    end
  end

  @doc false
  # Applies `config :llama_cpp_ex, limits: [...]` (the application's start).
  @spec apply_config() :: :ok
  def apply_config do
    case Application.get_env(:llama_cpp_ex, :limits, []) do
      [] ->
        :ok

      changes ->
        case put(changes) do
          :ok -> :ok
          {:error, reason} -> raise ArgumentError, "config :llama_cpp_ex, :limits: #{reason}"
        end
    end
  end
end
