defmodule LlamaCppEx.Server.Embeds do
  @moduledoc false
  # `LlamaCppEx.Server.embed/3` calls inside the server's forward passes: how many of a pass's
  # tokens waiting texts may take, which texts go on which embedding sequences, and what
  # happens to the vectors (or the failure) that come back.

  alias LlamaCppEx.Engine.Embed
  alias LlamaCppEx.Server.{EmbedJob, State, Stats}

  @doc "Whether texts wait to be placed in a step."
  @spec waiting?(State.t()) :: boolean()
  def waiting?(st), do: Enum.any?(st.embed_jobs, fn {_, j} -> j.todo != [] end)

  @doc "Texts of `embed/3` calls not yet placed in a step."
  @spec texts_waiting(State.t()) :: non_neg_integer()
  def texts_waiting(st),
    do: st.embed_jobs |> Map.values() |> Enum.map(&length(&1.todo)) |> Enum.sum()

  @doc """
  What waiting embedding texts may take of a pass: while requests generate, `:embed_chunk`
  tokens (their decode rows wait for the whole pass, so this bounds the inter-token latency
  embeddings add), else half the batch; always the first waiting text whole.
  """
  @spec share(State.t()) :: non_neg_integer()
  def share(st) do
    case Enum.find_value(st.embed_order, &waiting_job(st, &1)) do
      nil ->
        0

      job ->
        [{first, _} | _] = job.todo
        decoding = Enum.any?(st.slots, fn {_, s} -> s.state == :generating end)
        share = if decoding, do: st.config.embed_chunk, else: div(st.config.n_batch, 2)
        waiting = st.embed_jobs |> Map.values() |> Enum.map(& &1.waiting) |> Enum.sum()
        min(waiting, max(share, length(first)))
    end
  end

  defp waiting_job(st, ref) do
    case Map.fetch(st.embed_jobs, ref) do
      {:ok, %EmbedJob{todo: [_ | _]} = job} -> job
      _ -> nil
    end
  end

  @doc """
  Whole texts of the waiting jobs, first come first served, into the tokens `left` and the
  free embedding sequences: `{st, entries, embeds, placed}` where `placed` maps each
  sequence to its `{job_ref, text_index}`.
  """
  @spec place(State.t(), non_neg_integer()) ::
          {State.t(), list(), [Embed.t()],
           %{non_neg_integer() => {reference(), non_neg_integer()}}}
  def place(%State{embed_order: []} = st, _left), do: {st, [], [], %{}}

  def place(st, left) do
    {jobs, placed, _left, free} =
      Enum.reduce_while(st.embed_order, {st.embed_jobs, [], left, st.embed_free}, fn
        ref, {jobs, placed, left, free} ->
          job = Map.fetch!(jobs, ref)
          {job, taken, left, free} = EmbedJob.take(job, left, free)
          placed = placed ++ Enum.map(taken, &{&1, job})
          acc = {Map.put(jobs, ref, job), placed, left, free}
          # a job whose next text does not fit holds the ones behind it (first come first served)
          if job.todo == [], do: {:cont, acc}, else: {:halt, acc}
      end)

    entries =
      Enum.flat_map(placed, fn {{seq, _i, ids}, _job} ->
        ids |> Enum.with_index() |> Enum.map(fn {tok, pos} -> {tok, pos, seq, false} end)
      end)

    embeds =
      Enum.map(placed, fn {{seq, _i, _ids}, job} ->
        %Embed{seq: seq, pooling: job.pooling, normalize: job.normalize}
      end)

    by_seq = Map.new(placed, fn {{seq, i, _ids}, job} -> {seq, {job.ref, i}} end)
    {%{st | embed_jobs: jobs, embed_free: free}, entries, embeds, by_seq}
  end

  @doc "A text's vector; the call it belongs to may have ended meanwhile (cancelled, failed)."
  @spec apply(State.t(), map(), {non_neg_integer(), {:ok, binary()} | {:error, term()}}) ::
          State.t()
  def apply(st, placed, {seq, result}) do
    {ref, i} = Map.fetch!(placed, seq)

    case {Map.fetch(st.embed_jobs, ref), result} do
      {:error, _} ->
        st

      {{:ok, job}, {:ok, bin}} ->
        case EmbedJob.put(job, i, bin) do
          {:cont, job} ->
            %{st | embed_jobs: Map.put(st.embed_jobs, ref, job)}

          {:done, job} ->
            EmbedJob.reply(job, self())
            st |> drop(ref) |> Map.update!(:stats, &Stats.embeddings_done(&1, job.n_texts))
        end

      {{:ok, _job}, {:error, message}} ->
        fail(st, {ref, i}, message)
    end
  end

  @doc "Fails the call a text belongs to."
  @spec fail(State.t(), {reference(), non_neg_integer()}, term()) :: State.t()
  def fail(st, {ref, _i}, reason) do
    case Map.fetch(st.embed_jobs, ref) do
      {:ok, job} ->
        EmbedJob.fail(job, reason, self())
        drop(st, ref)

      :error ->
        st
    end
  end

  @doc "Forgets the call `ref` (answered, failed or cancelled)."
  @spec drop(State.t(), reference()) :: State.t()
  def drop(st, ref) do
    case Map.pop(st.embed_jobs, ref) do
      {nil, _} ->
        st

      {job, jobs} ->
        if job.monitor_ref, do: Process.demonitor(job.monitor_ref, [:flush])
        %{st | embed_jobs: jobs, embed_order: List.delete(st.embed_order, ref)}
    end
  end
end
