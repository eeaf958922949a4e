defmodule LlamaCppEx.Server.EmbedJob do
  @moduledoc false
  # One `LlamaCppEx.Server.embed/3` call from admission to its reply: its texts as token ids,
  # those not yet placed in a step, the vectors that came back, and who waits. A text rides in
  # one step as its own KV sequence (an embedding sequence id, not a slot), whole, and that
  # sequence is cleared by the engine when the step ends: no slot is held after the reply.

  alias LlamaCppEx.Telemetry

  @enforce_keys [:ref, :pid, :pooling, :normalize, :todo, :n_texts, :n_tokens, :t_start]
  # `waiting`: tokens of the texts in `todo` (kept, not summed, as every tick reads it)
  defstruct @enforce_keys ++ [:monitor_ref, :waiting, results: %{}]

  @type t :: %__MODULE__{
          ref: reference(),
          pid: pid(),
          pooling: integer(),
          normalize: integer(),
          # texts not yet placed in a step, with their index
          todo: [{[non_neg_integer()], non_neg_integer()}],
          n_texts: non_neg_integer(),
          n_tokens: non_neg_integer(),
          t_start: integer(),
          monitor_ref: reference() | nil,
          waiting: non_neg_integer(),
          # text index => its vector (f32 native-endian)
          results: %{non_neg_integer() => binary()}
        }

  @doc "A job for `ids` (one list per text) replying to `pid` as `{ref, result}`."
  @spec new([[non_neg_integer()]], integer(), integer(), pid(), reference()) :: t()
  def new(ids, pooling, normalize, pid, ref) do
    n_tokens = ids |> Enum.map(&length/1) |> Enum.sum()

    %__MODULE__{
      ref: ref,
      pid: pid,
      pooling: pooling,
      normalize: normalize,
      todo: Enum.with_index(ids),
      n_texts: length(ids),
      n_tokens: n_tokens,
      waiting: n_tokens,
      t_start: System.monotonic_time(:millisecond)
    }
  end

  @doc """
  Takes texts, in order, while each fits the `left` tokens and a free sequence id remains:
  `{job, [{seq, index, ids}], left, free}`.
  """
  @spec take(t(), non_neg_integer(), [non_neg_integer()]) ::
          {t(), list(), non_neg_integer(), [non_neg_integer()]}
  def take(job, left, free), do: take(job, left, free, [])

  defp take(%__MODULE__{todo: [{ids, i} | rest]} = job, left, [seq | free], acc)
       when length(ids) <= left do
    n = length(ids)
    take(%{job | todo: rest, waiting: job.waiting - n}, left - n, free, [{seq, i, ids} | acc])
  end

  defp take(job, left, free, acc), do: {job, Enum.reverse(acc), left, free}

  @doc "Records text `i`'s vector; `{:done, job}` once every text has one."
  @spec put(t(), non_neg_integer(), binary()) :: {:done | :cont, t()}
  def put(job, i, bin) do
    job = %{job | results: Map.put(job.results, i, bin)}
    {if(map_size(job.results) == job.n_texts, do: :done, else: :cont), job}
  end

  @doc "Replies with every vector, in text order."
  @spec reply(t(), pid()) :: :ok
  def reply(job, server) do
    bins = Enum.map(0..(job.n_texts - 1), &Map.fetch!(job.results, &1))
    send(job.pid, {job.ref, {:ok, bins}})

    Telemetry.execute([:llama_cpp_ex, :server, :embed, :done], measurements(job), %{
      server: server
    })
  end

  @doc "Replies with an error."
  @spec fail(t(), term(), pid()) :: :ok
  def fail(job, reason, server) do
    send(job.pid, {job.ref, {:error, reason}})

    Telemetry.execute(
      [:llama_cpp_ex, :server, :embed, :exception],
      measurements(job),
      %{server: server, reason: reason}
    )
  end

  defp measurements(job) do
    %{
      texts: job.n_texts,
      tokens: job.n_tokens,
      duration_ms: System.monotonic_time(:millisecond) - job.t_start
    }
  end
end
