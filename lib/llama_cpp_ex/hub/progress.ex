defmodule LlamaCppEx.Hub.Progress do
  @moduledoc false
  # A download's `:progress` callback at a human rate: the first call, then at most one call
  # per 100 ms or per 1% of the file, and the final `{total, total}` call, however small the
  # network's chunks (a 100 MB file arrives in ~67,000 of them). The counters are atomics, the
  # state an `:http_client`'s `into:` callback (a closure) can update.

  @interval_ms 100

  @enforce_keys [:fun, :ref]
  defstruct [:fun, :ref]

  @type t :: %__MODULE__{fun: (tuple() -> term()) | nil, ref: :atomics.atomics_ref() | nil}

  # slots: bytes so far, total (-1: unknown), bytes at the last report (-1: none), its time
  @got 1
  @total 2
  @reported 3
  @at 4

  @spec new((tuple() -> term()) | nil) :: t()
  def new(nil), do: %__MODULE__{fun: nil, ref: nil}

  def new(fun) do
    ref = :atomics.new(4, signed: true)
    :atomics.put(ref, @total, -1)
    :atomics.put(ref, @reported, -1)
    %__MODULE__{fun: fun, ref: ref}
  end

  @doc "`bytes` more arrived (of `total`, when known); reports if it is time."
  @spec advance(t(), non_neg_integer(), non_neg_integer() | nil) :: :ok
  def advance(%__MODULE__{fun: nil}, _bytes, _total), do: :ok

  def advance(%__MODULE__{ref: ref} = p, bytes, total) do
    if is_integer(total), do: :atomics.put(ref, @total, total)
    got = :atomics.add_get(ref, @got, bytes)
    now = System.monotonic_time(:millisecond)
    last = :atomics.get(ref, @reported)
    total = known_total(ref)

    due =
      last < 0 or got == total or now - :atomics.get(ref, @at) >= @interval_ms or
        (is_integer(total) and total > 0 and (got - last) * 100 >= total)

    if due, do: report(p, got, total, now)
    :ok
  end

  @doc "The final call, unless the last report already said it."
  @spec finish(t()) :: :ok
  def finish(%__MODULE__{fun: nil}), do: :ok

  def finish(%__MODULE__{ref: ref} = p) do
    got = :atomics.get(ref, @got)

    if :atomics.get(ref, @reported) != got or known_total(ref) != got,
      do: report(p, got, got, System.monotonic_time(:millisecond))

    :ok
  end

  defp known_total(ref) do
    case :atomics.get(ref, @total) do
      -1 -> nil
      n -> n
    end
  end

  defp report(%__MODULE__{fun: fun, ref: ref}, got, total, now) do
    :atomics.put(ref, @reported, got)
    :atomics.put(ref, @at, now)
    fun.({got, total})
  end
end
