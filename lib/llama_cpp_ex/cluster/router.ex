defmodule LlamaCppEx.Cluster.Router do
  @moduledoc false
  # Which replica takes a request: pure functions of the group's members, their published
  # loads and the request (the rule is documented in `LlamaCppEx.Cluster`).

  @typedoc "A member with its last published load (nil until one arrives) and this node's pending count."
  @type candidate :: {pid(), map() | nil, non_neg_integer()}

  @doc """
  The affinity key of a request: `{:session, s}` when `:session` is given; otherwise the
  `:cache_scope` with a hash of the prompt's first `prefix_bytes` bytes (of a chat: of its
  system messages' and of its first user message's, so every turn of a conversation shares
  it); `nil`
  for input with no prefix (embeddings).
  """
  @spec key(:text | :chat | :none, term(), keyword(), pos_integer()) :: term() | nil
  def key(kind, input, opts, prefix_bytes) do
    case opts[:session] do
      nil -> prefix_key(kind, input, opts[:cache_scope], prefix_bytes)
      session -> {:session, session}
    end
  end

  defp prefix_key(:text, prompt, scope, n) when is_binary(prompt),
    do: {scope, :erlang.phash2(cut(prompt, n))}

  # the system messages and the first user message, each cut to `n` bytes: a long shared
  # system prompt does not hide which conversation this is
  defp prefix_key(:chat, messages, scope, n) when is_list(messages) do
    {head, rest} = Enum.split_while(messages, &(role(&1) == "system"))
    first_user = Enum.take(Enum.drop_while(rest, &(role(&1) != "user")), 1)
    system = cut(IO.iodata_to_binary(Enum.map(head, &[content(&1), ?\n])), n)
    user = cut(IO.iodata_to_binary(Enum.map(first_user, &content/1)), n)
    {scope, :erlang.phash2({system, user})}
  end

  defp prefix_key(_, _, _, _), do: nil

  defp cut(text, n), do: binary_part(text, 0, min(byte_size(text), n))

  defp role(%{role: r}), do: to_string(r)
  defp role(%{"role" => r}), do: to_string(r)
  defp role({r, _}), do: to_string(r)
  defp role(_), do: ""

  defp content(%{content: c}), do: text(c)
  defp content(%{"content" => c}), do: text(c)
  defp content({_, c}), do: text(c)
  defp content(_), do: ""

  defp text(c) when is_binary(c), do: c
  defp text(c), do: :erlang.term_to_binary(c)

  @doc """
  The candidates in the order to try them: the first takes the request, the next one takes
  a retry. `route` is `:affinity` (rendezvous order of `key` with bounded load; least loaded
  without a key), `:least_loaded` or `:random`.
  """
  @spec order([candidate()], :affinity | :least_loaded | :random, term() | nil, map()) :: [pid()]
  def order(candidates, :random, _key, _conf), do: candidates |> Enum.shuffle() |> pids()

  def order(candidates, route, key, _conf) when route == :least_loaded or key == nil,
    do: candidates |> Enum.shuffle() |> Enum.sort_by(&score/1) |> pids()

  def order(candidates, :affinity, key, conf) do
    ranked =
      Enum.sort_by(candidates, fn {pid, _, _} -> -:erlang.phash2({key, pid}, 4_294_967_296) end)

    {fit, over} = Enum.split_with(ranked, &(not overloaded?(&1, conf)))
    pids(fit ++ Enum.sort_by(over, &score/1))
  end

  @doc "Whether a replica's requests would wait (beyond `:max_waiting`) or its KV is too full."
  @spec overloaded?(candidate(), map()) :: boolean()
  def overloaded?({_pid, nil, _pending}, _conf), do: false

  def overloaded?({_pid, load, pending}, conf) do
    waiting = load.queue_depth + max(pending - load.free_slots, 0)
    kv_used = 1 - load.kv_free_tokens / max(load.n_ctx, 1)
    waiting > conf[:max_waiting] or kv_used > conf[:max_kv_use]
  end

  # busy slots, waiting requests and requests on their way, per slot
  defp score({_pid, nil, pending}), do: pending

  defp score({_pid, load, pending}),
    do: (load.n_parallel - load.free_slots + load.queue_depth + pending) / load.n_parallel

  defp pids(candidates), do: Enum.map(candidates, &elem(&1, 0))
end
