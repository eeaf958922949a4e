defmodule LlamaCppEx.ModelManager.Budget do
  @moduledoc """
  The memory budget of `LlamaCppEx.ModelManager`: pure functions that resolve the
  `:memory_budget` option, estimate where a model's bytes go and check them against what is
  already loaded.

  This engine keeps every weight in host memory, so on it placements have no VRAM part; the
  per-device forms are kept so that budgets written for `llama_cpp_ex` (GPU builds) still
  resolve.

      iex> alias LlamaCppEx.ModelManager.Budget
      iex> budget = Budget.resolve(1_000)
      iex> placement = Budget.distribute(600, [mode: :direct], 0)
      iex> Budget.check(budget, placement, Budget.empty_usage())
      :ok
      iex> Budget.check(budget, placement, Budget.add_usage(Budget.empty_usage(), placement))
      {:error, {:insufficient_memory, device: :total, required: 600, available: 400}}
  """

  @typedoc "A resolved budget."
  @type t ::
          %{mode: :unlimited}
          | %{mode: :combined, limit: non_neg_integer()}
          | %{
              mode: :per_device,
              ram: non_neg_integer() | :infinity,
              vram: %{non_neg_integer() => non_neg_integer() | :infinity}
            }

  @typedoc "Bytes per device."
  @type usage :: %{ram: non_neg_integer(), vram: %{non_neg_integer() => non_neg_integer()}}

  @kv_bytes_per_token_layer_default 2 * 1024

  @doc """
  Resolves `:memory_budget`: `:infinity`, `:auto` (80% of the system's RAM plus the free
  memory of each GPU in `gpu_devices`), bytes, or `%{ram: …, vram: […] | %{i => …} | :auto}`.
  """
  @spec resolve(term(), [map()]) :: t()
  def resolve(opt, gpu_devices \\ [])
  def resolve(:infinity, _gpus), do: %{mode: :unlimited}
  def resolve(nil, _gpus), do: %{mode: :unlimited}

  def resolve(:auto, gpus) do
    ram = trunc(total_ram() * 0.8)
    vram = gpus |> Enum.map(&Map.get(&1, :memory_free, 0)) |> Enum.sum()
    %{mode: :combined, limit: ram + vram}
  end

  def resolve(bytes, _gpus) when is_integer(bytes) and bytes >= 0,
    do: %{mode: :combined, limit: bytes}

  def resolve(%{} = m, gpus) do
    ram =
      case Map.get(m, :ram, :infinity) do
        :auto -> trunc(total_ram() * 0.8)
        v -> v
      end

    vram =
      case Map.get(m, :vram, %{}) do
        :auto ->
          gpus |> Enum.with_index() |> Map.new(fn {g, i} -> {i, Map.get(g, :memory_free, 0)} end)

        list when is_list(list) ->
          list |> Enum.with_index() |> Map.new(fn {v, i} -> {i, v} end)

        %{} = map ->
          map
      end

    %{mode: :per_device, ram: ram, vram: vram}
  end

  def resolve(other, _gpus) do
    raise ArgumentError,
          "invalid :memory_budget #{inspect(other)}, expected :infinity, :auto, bytes or " <>
            "%{ram: …, vram: …}"
  end

  @doc """
  Where `file_bytes` of weights (plus, in `mode: :server`, the default, a KV estimate of
  2 × 1024 bytes × `n_ctx` (8192) × `n_parallel` (4)) go. With no GPUs or `n_gpu_layers: 0`
  everything is RAM. Otherwise, as `llama_cpp_ex` places it: `split_mode: :none` (the
  default) puts the whole footprint on `main_gpu` (0); `:layer` and `:row` spread it by
  `tensor_split` weights (a zero weight leaves that GPU out), evenly when the split is
  empty. `offload_kqv: false` keeps the KV estimate in RAM.
  """
  @spec distribute(non_neg_integer(), keyword(), non_neg_integer()) :: usage()
  def distribute(file_bytes, opts, n_gpus) do
    kv =
      if Keyword.get(opts, :mode, :server) == :server,
        do:
          @kv_bytes_per_token_layer_default * Keyword.get(opts, :n_ctx, 8192) *
            max(Keyword.get(opts, :n_parallel, 4), 1),
        else: 0

    if n_gpus == 0 or Keyword.get(opts, :n_gpu_layers, 99) == 0 do
      %{ram: file_bytes + kv, vram: %{}}
    else
      {on_gpu, ram} =
        if Keyword.get(opts, :offload_kqv, true), do: {file_bytes + kv, 0}, else: {file_bytes, kv}

      weights = split_weights(opts, n_gpus)
      total = weights |> Map.values() |> Enum.sum()
      %{ram: ram, vram: Map.new(weights, fn {i, w} -> {i, round(on_gpu * w / total)} end)}
    end
  end

  # %{gpu => weight}, zero weights left out
  defp split_weights(opts, n_gpus) do
    case {Keyword.get(opts, :split_mode, :none), Keyword.get(opts, :tensor_split, [])} do
      {:none, _} ->
        %{Keyword.get(opts, :main_gpu, 0) => 1}

      {_, []} ->
        Map.new(0..(n_gpus - 1), &{&1, 1})

      {_, split} ->
        for {w, i} <- Enum.with_index(split), w != 0, into: %{}, do: {i, w}
    end
  end

  @doc "No bytes anywhere."
  @spec empty_usage() :: usage()
  def empty_usage, do: %{ram: 0, vram: %{}}

  @doc "`usage` plus a placement."
  @spec add_usage(usage(), usage()) :: usage()
  def add_usage(usage, placement) do
    %{
      ram: usage.ram + placement.ram,
      vram: Map.merge(usage.vram, placement.vram, fn _i, a, b -> a + b end)
    }
  end

  @doc "`:ok` when `placement` fits beside `used`, else the first device it overflows."
  @spec check(t(), usage(), usage()) ::
          :ok | {:error, {:insufficient_memory, keyword()}}
  def check(%{mode: :unlimited}, _placement, _used), do: :ok

  def check(%{mode: :combined, limit: limit}, placement, used) do
    required = placement.ram + Enum.sum(Map.values(placement.vram))
    available = limit - used.ram - Enum.sum(Map.values(used.vram))
    fits(:total, required, available)
  end

  def check(%{mode: :per_device, ram: ram, vram: vram}, placement, used) do
    with :ok <- fits(:ram, placement.ram, minus(ram, used.ram)) do
      Enum.reduce_while(placement.vram, :ok, fn {i, bytes}, :ok ->
        case fits({:gpu, i}, bytes, minus(Map.get(vram, i, :infinity), Map.get(used.vram, i, 0))) do
          :ok -> {:cont, :ok}
          error -> {:halt, error}
        end
      end)
    end
  end

  defp minus(:infinity, _), do: :infinity
  defp minus(limit, used), do: limit - used

  defp fits(_device, _required, :infinity), do: :ok
  defp fits(_device, required, available) when required <= available, do: :ok

  defp fits(device, required, available),
    do:
      {:error,
       {:insufficient_memory, device: device, required: required, available: max(available, 0)}}

  @doc "Total RAM in bytes (Linux `/proc/meminfo`; otherwise the BEAM's `memsup` if running)."
  @spec total_ram() :: non_neg_integer()
  def total_ram do
    with {:ok, text} <- File.read("/proc/meminfo"),
         [_, kb] <- Regex.run(~r/MemTotal:\s+(\d+) kB/, text) do
      String.to_integer(kb) * 1024
    else
      _ -> 8 * 1024 * 1024 * 1024
    end
  end
end
