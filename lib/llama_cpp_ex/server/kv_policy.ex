defmodule LlamaCppEx.Server.KvPolicy do
  @moduledoc """
  KV cache precision under memory pressure: a `LlamaCppEx.Server` started with `:kv_policy`
  writes new KV blocks in f16 while its cache has room and switches them to `q8_0`, then
  `q4_0`, as the cache fills, so more sequences (or longer ones) fit in the same bytes.

      LlamaCppEx.Server.start_link(
        model_path: "model.gguf",
        n_ctx: 4096,
        kv_policy: [q8_threshold: 0.80, q4_threshold: 0.95]
      )

  `kv_policy: []` (or `true`) takes every default. Options:

    * `:q8_threshold` - occupancy (0..1] at which new blocks become `q8_0`. Default 0.80.
    * `:q4_threshold` - occupancy at which they become `q4_0`; above `:q8_threshold`. Default 0.95.
    * `:hysteresis` - how far below a threshold the occupancy must fall before new blocks go
      back to the higher precision, so a cache hovering at a threshold does not flip every
      tick. In `[0, q8_threshold)`. Default 0.05.
    * `:ewma_alpha` - weight of the newest measurement in the moving average, in (0, 1].
      Default 0.20.
    * `:min` / `:max` - the highest and the lowest precision the policy may use, from
      `:f16`, `:q8_0`, `:q4_0` (`:min` higher than `:max`). Defaults `:f16` / `:q4_0`.

  ## How it decides

  After every forward pass the server reads the cache's occupancy (bytes of blocks in use,
  idle prompt caches included, ÷ the byte budget; the fullest layer group) and updates
  `ewma = alpha · occupancy + (1 - alpha) · ewma`. The precision of blocks allocated from
  then on is the lowest one whose threshold the average reached; it goes back up one level
  only when the average is `:hysteresis` below that level's threshold. Blocks already written
  keep their precision (nothing is re-quantized), so a sequence may hold f16 blocks from its
  prompt and q8_0 blocks from its answer; attention reads each block in its own format. A
  block that does not fit the remaining budget at the chosen precision is written at a lower
  one (down to `:max`) rather than failing its request, since the average lags a burst.
  Admission (`get_stats/1`'s free tokens) counts the free budget at the chosen precision.

  With the defaults, a server whose load stays under 80% of its cache never leaves f16; see
  docs/performance.md ("KV cache types and the pressure policy") for what eager and default
  settings do on a full server.

  ## Memory

  The byte budget is `n_ctx` tokens (or `:kv_budget_mb`) at the `:min` precision: the
  cache never holds more bytes than that, whatever mix of precisions it holds, and the pages
  of freed blocks are returned to the OS. `:type_k` / `:type_v` are chosen by the policy
  (`:min`); giving other ones with `:kv_policy` is an error.

  Each change is a `[:llama_cpp_ex, :server, :kv_precision]` telemetry event (measurements
  `occupancy`, `ewma`; metadata `server`, `from`, `to`), and `LlamaCppEx.Server.get_stats/1`
  reports `kv_precision`, `kv_occupancy`, `kv_occupancy_ewma` and `kv_precision_changes`.

  The decision is a pure function of the state and the measurement:

      iex> {:ok, p} = LlamaCppEx.Server.KvPolicy.new(ewma_alpha: 1.0)
      iex> {p, change} = LlamaCppEx.Server.KvPolicy.update(p, 0.85)
      iex> {p.level, change}
      {:q8_0, {:f16, :q8_0}}
      iex> {p, nil} = LlamaCppEx.Server.KvPolicy.update(p, 0.77)
      iex> p.level
      :q8_0
      iex> {p, _} = LlamaCppEx.Server.KvPolicy.update(p, 0.74)
      iex> p.level
      :f16
  """

  @levels [:f16, :q8_0, :q4_0]
  @defaults [
    q8_threshold: 0.80,
    q4_threshold: 0.95,
    hysteresis: 0.05,
    ewma_alpha: 0.20,
    min: :f16,
    max: :q4_0
  ]

  defstruct q8_threshold: 0.80,
            q4_threshold: 0.95,
            hysteresis: 0.05,
            ewma_alpha: 0.20,
            min: :f16,
            max: :q4_0,
            level: :f16,
            ewma: 0.0,
            occupancy: 0.0,
            changes: 0

  @type level :: :f16 | :q8_0 | :q4_0

  @type t :: %__MODULE__{
          q8_threshold: float(),
          q4_threshold: float(),
          hysteresis: float(),
          ewma_alpha: float(),
          min: level(),
          max: level(),
          level: level(),
          ewma: float(),
          occupancy: float(),
          changes: non_neg_integer()
        }

  @doc """
  A policy from the `:kv_policy` option (`true` or a keyword list), starting at `:min`.
  Unknown keys raise `ArgumentError`; values out of range are
  `{:error, {:invalid_kv_policy, message}}`.

      iex> LlamaCppEx.Server.KvPolicy.new(q8_threshold: 0.9, q4_threshold: 0.8)
      {:error, {:invalid_kv_policy, ":q4_threshold (0.8) must be above :q8_threshold (0.9)"}}
  """
  @spec new(true | keyword()) :: {:ok, t()} | {:error, {:invalid_kv_policy, String.t()}}
  def new(true), do: new([])

  def new(opts) when is_list(opts) do
    LlamaCppEx.Options.validate!(opts, Keyword.keys(@defaults), "kv_policy")
    o = Keyword.merge(@defaults, opts)

    with :ok <- number(o, :q8_threshold, &(&1 > 0 and &1 <= 1), "in (0, 1]"),
         :ok <- number(o, :q4_threshold, &(&1 > 0 and &1 <= 1), "in (0, 1]"),
         :ok <- number(o, :ewma_alpha, &(&1 > 0 and &1 <= 1), "in (0, 1]"),
         :ok <-
           number(o, :hysteresis, &(&1 >= 0 and &1 < o[:q8_threshold]), "in [0, q8_threshold)"),
         :ok <- ordered(o),
         :ok <- bounds(o) do
      policy = struct!(__MODULE__, Enum.map(o, fn {k, v} -> {k, float(v)} end))
      {:ok, %{policy | level: o[:min]}}
    end
  end

  def new(other), do: invalid("expected a keyword list or true, got: #{inspect(other)}")

  @doc "The precisions the cache holds, highest first: `:min` to `:max`."
  @spec levels(t()) :: [level()]
  def levels(%__MODULE__{min: min, max: max}),
    do: Enum.slice(@levels, rank(min)..rank(max))

  @doc "The index of the policy's level in `levels/1` (the cache's write tier)."
  @spec tier(t()) :: non_neg_integer()
  def tier(%__MODULE__{} = p), do: rank(p.level) - rank(p.min)

  @doc """
  Takes one occupancy measurement (0..1): the new state and `{from, to}` when the level
  changed, else `nil`.
  """
  @spec update(t(), number()) :: {t(), {level(), level()} | nil}
  def update(%__MODULE__{} = p, occupancy) do
    ewma = p.ewma_alpha * occupancy + (1 - p.ewma_alpha) * p.ewma
    up = level_at(p, ewma, 0.0)
    # going back up a level needs the average `hysteresis` below that level's threshold
    down = level_at(p, ewma, p.hysteresis)
    level = Enum.at(@levels, max(rank(up), min(rank(p.level), rank(down))))
    level = Enum.at(@levels, rank(level) |> max(rank(p.min)) |> min(rank(p.max)))
    p = %{p | ewma: ewma, occupancy: occupancy * 1.0}

    if level == p.level,
      do: {p, nil},
      else: {%{p | level: level, changes: p.changes + 1}, {p.level, level}}
  end

  @doc "The `LlamaCppEx.Server.get_stats/1` fields of a policy (none without one)."
  @spec stats(t() | nil) :: map()
  def stats(nil), do: %{}

  def stats(%__MODULE__{} = p) do
    %{
      kv_precision: p.level,
      kv_occupancy: p.occupancy,
      kv_occupancy_ewma: p.ewma,
      kv_precision_changes: p.changes
    }
  end

  defp level_at(p, x, margin) do
    cond do
      x >= p.q4_threshold - margin -> :q4_0
      x >= p.q8_threshold - margin -> :q8_0
      true -> :f16
    end
  end

  defp rank(level), do: Enum.find_index(@levels, &(&1 == level))

  defp number(o, key, ok?, range) do
    v = o[key]

    if is_number(v) and ok?.(v),
      do: :ok,
      else: invalid("#{inspect(key)} must be a number #{range}, got: #{inspect(v)}")
  end

  defp ordered(o) do
    if o[:q4_threshold] > o[:q8_threshold],
      do: :ok,
      else:
        invalid(
          ":q4_threshold (#{o[:q4_threshold]}) must be above :q8_threshold (#{o[:q8_threshold]})"
        )
  end

  defp bounds(o) do
    cond do
      o[:min] not in @levels ->
        invalid(":min must be one of #{inspect(@levels)}, got: #{inspect(o[:min])}")

      o[:max] not in @levels ->
        invalid(":max must be one of #{inspect(@levels)}, got: #{inspect(o[:max])}")

      rank(o[:min]) >= rank(o[:max]) ->
        invalid(
          ":min (#{inspect(o[:min])}) must be a higher precision than :max (#{inspect(o[:max])})"
        )

      true ->
        :ok
    end
  end

  defp float(v) when is_number(v), do: v * 1.0
  defp float(v), do: v

  defp invalid(message), do: {:error, {:invalid_kv_policy, message}}
end
