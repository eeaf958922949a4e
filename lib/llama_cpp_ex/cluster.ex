defmodule LlamaCppEx.Cluster do
  @moduledoc """
  `LlamaCppEx.Server` replicas on several BEAM nodes, one `:pg` group per model, with requests
  routed to where their prompt's KV prefix is likely cached.

      # on every node that serves the model
      {LlamaCppEx.Server, model_path: path, n_parallel: 4, cluster: :smollm2}

      # on any connected node (one that serves nothing included)
      {:ok, text} = LlamaCppEx.Cluster.generate(:smollm2, "Once upon a time", max_tokens: 64)
      LlamaCppEx.Cluster.stream_chat(:smollm2, messages, session: user_id) |> Enum.each(&IO.write/1)

  The request functions take the group where the Server functions take a server, and then
  the same arguments, options, return shapes and errors, plus the routing options `:route` and
  `:replica`. The request runs on the replica's node (its prompt is tokenized and rendered
  there, against the replica's model) and its tokens stream straight to the caller.

  ## Routing

  Every replica publishes a load signal (free slots, queue depth, and the KV tokens a new
  request can have: free blocks plus the idle caches it may evict) to a
  directory on every node when it changes, at most every `:publish_ms` and at least every
  `:heartbeat_ms`; a caller's own node decides from its copy (its directory takes one
  request at a time, so that simultaneous callers see each other's choices), so routing sends
  nothing across nodes. Each request has an affinity key:

    * `:session` when given;
    * otherwise the `:cache_scope` with a hash of the prompt's first `:prefix_tokens` tokens'
      worth of text (`:prefix_tokens` × 4 bytes; 64 tokens, four KV blocks of 16, by default).
      For a chat, that much of its system messages and that much of its first user message,
      so every turn of a conversation has the same key, and conversations that share a long
      system prompt but open differently spread over the replicas (each replica caches the
      shared system prompt once; a conversation's own history stays where it is cached).

  The replicas are ranked by rendezvous hashing of the key (each replica scores
  `phash2({key, pid})`, highest first), so a key keeps its replica while the group changes
  elsewhere. Load bounds the choice: a replica whose requests would wait (queue depth plus
  requests this node sent since its last signal beyond its free slots) more than
  `:max_waiting`, or whose KV cache is more than `:max_kv_use` full, is skipped for the next
  one in hash order; when all are over, the least loaded takes it. Requests with no key
  (`embed/3`), or `route: :least_loaded`, go to the least loaded replica (busy slots plus
  waiting requests per slot; ties broken at random); `route: :random` picks at random (for
  comparisons). `replica: pid` forces one replica of the group.

  Knobs and their defaults (`config :llama_cpp_ex, LlamaCppEx.Cluster, ...`):
  `prefix_tokens: 64`, `max_waiting: 2`, `max_kv_use: 0.9`, `publish_ms: 100`,
  `heartbeat_ms: 1000`.

  ## Failures

    * A group with no replicas answers `{:error, :no_replicas}` at once; `replica:` naming a
      pid outside the group, `{:error, {:not_a_replica, pid}}`.
    * A replica (or its node) that goes down fails its requests in flight with
      `{:error, :replica_down}`, as soon as the monitor fires (at once when the node's
      connection closes); a stream ends with it as its last element. A request the replica
      had not accepted yet is retried once on the next replica in order. `:pg` drops the
      replica from the group when it or its node goes, so new requests go elsewhere.
    * A caller that dies, or halts its stream, cancels the remote request: the replica frees
      the slot within a tick (monitors across nodes).

  Connecting nodes, the security model and how this compares with llama.cpp's RPC and
  Nx.Serving: README, "Several machines".
  """

  alias LlamaCppEx.Cluster.{Directory, Proxy, Router}
  alias LlamaCppEx.Server

  @defaults [
    prefix_tokens: 64,
    max_waiting: 2,
    max_kv_use: 0.9,
    publish_ms: 100,
    heartbeat_ms: 1000
  ]
  @routes [:affinity, :least_loaded, :random]
  # bytes of text per token when the key's prefix is measured before tokenization
  @bytes_per_token 4
  # after a proxy's normal exit, how long its worker's last message may still be on its way
  @last_message_ms 1000

  @doc false
  @spec scope() :: atom()
  def scope, do: __MODULE__

  @doc false
  @spec directories() :: term()
  def directories, do: {__MODULE__, :directories}

  @doc false
  @spec config() :: keyword()
  def config, do: Keyword.merge(@defaults, Application.get_env(:llama_cpp_ex, __MODULE__, []))

  @doc """
  Joins a running Server to `group` (what `start_link/1`'s `cluster: group` does once its
  model is loaded). `{:error, :not_a_server}` for a process that is not a `LlamaCppEx.Server`.
  """
  @spec join(GenServer.server(), term()) :: :ok | {:error, :not_a_server}
  def join(server, group), do: member_call(server, {:cluster, :join, group})

  @doc "Takes a Server out of `group`; a no-op when it is not in it."
  @spec leave(GenServer.server(), term()) :: :ok | {:error, :not_a_server}
  def leave(server, group), do: member_call(server, {:cluster, :leave, group})

  defp member_call(server, message) do
    pid = GenServer.whereis(server)

    if is_pid(pid) and server?(pid),
      do: GenServer.call(pid, message, 60_000),
      else: {:error, :not_a_server}
  end

  defp server?(pid) do
    :erpc.call(node(pid), __MODULE__, :local_server?, [pid], 5_000)
  catch
    _, _ -> false
  end

  @doc false
  @spec local_server?(pid()) :: boolean()
  def local_server?(pid) do
    case Process.info(pid, :dictionary) do
      {:dictionary, dict} -> dict[:"$initial_call"] == {Server, :init, 1}
      nil -> false
    end
  end

  @doc """
  The group's replicas with the load each last published: `[%{node:, pid:, free_slots:,
  queue_depth:, kv_free_tokens:, model:}]` (the load fields are nil until its first signal
  reaches this node).
  """
  @spec replicas(term()) :: [map()]
  def replicas(group) do
    for pid <- members(group) do
      base = %{node: node(pid), pid: pid}

      case Directory.lookup(pid) do
        {%{} = load, _} ->
          Map.merge(base, Map.take(load, [:free_slots, :queue_depth, :kv_free_tokens, :model]))

        _ ->
          Map.merge(base, %{free_slots: nil, queue_depth: nil, kv_free_tokens: nil, model: nil})
      end
    end
  end

  defp members(group), do: :pg.get_members(scope(), group)

  # ------------------------------------------------------------------ requests

  @doc "`LlamaCppEx.Server.generate/3` on a replica of `group`."
  @spec generate(term(), String.t(), keyword()) :: {:ok, String.t()} | {:error, term()}
  def generate(group, prompt, opts \\ []), do: call(group, :generate, :text, prompt, opts)

  @doc "`LlamaCppEx.Server.chat/3` on a replica of `group`."
  @spec chat(term(), [LlamaCppEx.Chat.message()], keyword()) ::
          {:ok, String.t()} | {:error, term()}
  def chat(group, messages, opts \\ []), do: call(group, :chat, :chat, messages, opts)

  @doc "`LlamaCppEx.chat_completion/3` on a replica of `group`."
  @spec chat_completion(term(), [LlamaCppEx.Chat.message()], keyword()) ::
          {:ok, LlamaCppEx.ChatCompletion.t()} | {:error, term()}
  def chat_completion(group, messages, opts \\ []),
    do: call(group, :chat_completion, :chat, messages, opts)

  @doc "`LlamaCppEx.Server.embed/3` on the least loaded replica of `group`."
  @spec embed(term(), [String.t()], keyword()) :: {:ok, list()} | {:error, term()}
  def embed(group, texts, opts \\ []), do: call(group, :embed, :none, texts, opts)

  @doc "`LlamaCppEx.Server.stream/3` on a replica of `group`."
  @spec stream(term(), String.t(), keyword()) :: Enumerable.t()
  def stream(group, prompt, opts \\ []), do: open_stream(group, :stream, :text, prompt, opts)

  @doc "`LlamaCppEx.Server.stream_chat/3` on a replica of `group`."
  @spec stream_chat(term(), [LlamaCppEx.Chat.message()], keyword()) :: Enumerable.t()
  def stream_chat(group, messages, opts \\ []),
    do: open_stream(group, :stream_chat, :chat, messages, opts)

  @doc "`LlamaCppEx.stream_chat_completion/3` on a replica of `group`."
  @spec stream_chat_completion(term(), [LlamaCppEx.Chat.message()], keyword()) :: Enumerable.t()
  def stream_chat_completion(group, messages, opts \\ []),
    do: open_stream(group, :stream_chat_completion, :chat, messages, opts)

  defp routing!(opts) do
    {routing, opts} = Keyword.split(opts, [:route, :replica])

    case routing[:route] do
      r when r == nil or r in @routes -> :ok
      r -> raise ArgumentError, "unknown :route #{inspect(r)} (one of #{inspect(@routes)})"
    end

    case routing[:replica] do
      p when p == nil or is_pid(p) -> :ok
      p -> raise ArgumentError, ":replica must be a pid, got: #{inspect(p)}"
    end

    {routing, opts}
  end

  # The replicas in the order to try them: `{:ok, [first, retry]}` or an error.
  defp route(group, kind, input, opts, routing) do
    case {members(group), routing[:replica]} do
      {[], _} ->
        {:error, :no_replicas}

      {members, nil} ->
        conf = Map.new(config())
        key = Router.key(kind, input, opts, conf.prefix_tokens * @bytes_per_token)
        {:ok, Enum.take(Directory.claim(members, routing[:route] || :affinity, key, conf), 2)}

      {members, pid} ->
        if pid in members, do: {:ok, [pid]}, else: {:error, {:not_a_replica, pid}}
    end
  end

  defp call(group, fun, kind, input, opts) do
    {routing, opts} = routing!(opts)

    with {:ok, order} <- route(group, kind, input, opts, routing),
         do: attempt(order, fun, [input, opts])
  end

  defp attempt([pid | rest], fun, args) do
    {ref, mon, proxy} = dispatch(pid, fun, args)
    flight = %{ref: ref, mon: mon, proxy: proxy, replica: pid, fun: fun, args: args}

    case await_result(flight, false) do
      :retry ->
        Directory.forget(pid)
        if rest == [], do: {:error, :replica_down}, else: attempt(rest, fun, args)

      result ->
        result
    end
  end

  # A replica on a node this one is not connected to (gone, its group not yet updated) is
  # not dialled: its proxy is a process that is already down, so the request is retried.
  defp dispatch(pid, fun, args) do
    ref = make_ref()
    node = node(pid)

    {proxy, mon} =
      if node == node() or node in Node.list(),
        do: Node.spawn_monitor(node, Proxy, :start, [self(), ref, pid, {fun, args}]),
        else: spawn_monitor(fn -> exit(:noconnection) end)

    {ref, mon, proxy}
  end

  # `wait`: :infinity while the proxy is up; after its normal exit, how long its worker's
  # last message may still be on the way
  defp await_result(%{ref: ref, mon: mon} = flight, accepted?, wait \\ :infinity) do
    receive do
      {^ref, :accepted} ->
        await_result(flight, true, wait)

      {^ref, :sse} ->
        # an OpenAI stream: its events follow as a stream's elements
        st =
          Map.merge(flight, %{
            rest: [],
            accepted?: true,
            down: {:error, down_body()},
            wait: :infinity
          })

        {:sse, Stream.resource(fn -> st end, &next/1, &close/1)}

      {^ref, :unavailable} ->
        Process.demonitor(mon, [:flush])
        :retry

      {^ref, {:result, result}} ->
        Process.demonitor(mon, [:flush])
        replica_error(result)

      {^ref, {:raise, e, stacktrace}} ->
        Process.demonitor(mon, [:flush])
        reraise e, stacktrace

      {^ref, {:exit, reason}} ->
        Process.demonitor(mon, [:flush])
        exit(reason)

      {:DOWN, ^mon, :process, _, :normal} ->
        # finished: its worker's answer (another sender) may still be on the way
        await_result(flight, accepted?, @last_message_ms)

      {:DOWN, ^mon, :process, _, _reason} ->
        if accepted?, do: {:error, :replica_down}, else: :retry
    after
      wait -> {:error, :replica_down}
    end
  end

  # a replica that died under the request answers as the Server would for a dead server
  defp replica_error({:error, reason}) when reason in [:server_down, :noproc],
    do: {:error, :replica_down}

  defp replica_error(other), do: other

  # ------------------------------------------------------------------ OpenAI

  @doc false
  # `LlamaCppEx.OpenAI.handle/4` for an API over a group: routed by the request it carries
  # (its messages or prompt), and run on the replica's node against that replica.
  @spec handle_openai(LlamaCppEx.OpenAI.t(), String.t(), String.t(), map()) ::
          LlamaCppEx.OpenAI.result()
  def handle_openai(%{cluster: group} = api, method, path, body) do
    {kind, input} = openai_input(body)

    case route(group, kind, input, [], []) do
      {:ok, order} ->
        case attempt(order, :openai, [%{api | cluster: nil}, method, path, body]) do
          {:error, :replica_down} -> {:json, 503, down_body()}
          result -> result
        end

      {:error, :no_replicas} ->
        LlamaCppEx.OpenAI.error(503, "no replica of the model is running", "unavailable_error")
    end
  end

  defp openai_input(%{"messages" => messages}) when is_list(messages), do: {:chat, messages}
  defp openai_input(%{"prompt" => prompt}) when is_binary(prompt), do: {:text, prompt}
  defp openai_input(_), do: {:none, nil}

  defp down_body do
    {:json, 503, body} =
      LlamaCppEx.OpenAI.error(
        503,
        "the replica serving the request went down",
        "unavailable_error"
      )

    body
  end

  # ------------------------------------------------------------------ streams

  defp open_stream(group, fun, kind, input, opts) do
    {routing, opts} = routing!(opts)
    # the call's own checks raise here, in the caller, as the Server's stream functions do
    _ = Proxy.run(self(), fun, [input, opts])

    Stream.resource(
      fn ->
        case route(group, kind, input, opts, routing) do
          {:ok, [pid | rest]} ->
            {ref, mon, proxy} = dispatch(pid, fun, [input, opts])

            %{
              ref: ref,
              mon: mon,
              proxy: proxy,
              replica: pid,
              rest: rest,
              fun: fun,
              args: [input, opts],
              accepted?: false,
              down: {:error, :replica_down},
              wait: :infinity
            }

          {:error, reason} ->
            {:failed, reason}
        end
      end,
      &next/1,
      &close/1
    )
  end

  defp next({:failed, reason}), do: {[{:error, reason}], :halted}
  defp next(:halted), do: {:halt, :halted}

  defp next(%{ref: ref, mon: mon} = st) do
    receive do
      {^ref, :accepted} ->
        next(%{st | accepted?: true})

      {^ref, {:element, {:error, reason}}} ->
        {[replica_error({:error, reason})], %{st | accepted?: true}}

      {^ref, {:element, e}} ->
        {[e], %{st | accepted?: true}}

      {^ref, :done} ->
        Process.demonitor(mon, [:flush])
        {:halt, :halted}

      {^ref, :unavailable} ->
        Process.demonitor(mon, [:flush])
        retry(st)

      {^ref, {:raise, e, stacktrace}} ->
        Process.demonitor(mon, [:flush])
        reraise e, stacktrace

      {^ref, {:exit, reason}} ->
        Process.demonitor(mon, [:flush])
        exit(reason)

      {:DOWN, ^mon, :process, _, :normal} ->
        # finished: its worker's last elements (another sender) may still be on the way
        next(%{st | wait: @last_message_ms})

      {:DOWN, ^mon, :process, _, _reason} ->
        if st.accepted?, do: {[st.down], :halted}, else: retry(st)
    after
      st.wait -> {[st.down], :halted}
    end
  end

  defp retry(st) do
    Directory.forget(st.replica)

    case st.rest do
      [pid | _] ->
        {ref, mon, proxy} = dispatch(pid, st.fun, st.args)

        next(%{
          st
          | ref: ref,
            mon: mon,
            proxy: proxy,
            replica: pid,
            rest: [],
            accepted?: false,
            wait: :infinity
        })

      [] ->
        {[st.down], :halted}
    end
  end

  # halting early (or any end): stop the remote request and drop what is still in flight
  defp close(%{ref: ref, mon: mon, proxy: proxy}) do
    Process.exit(proxy, :kill)
    Process.demonitor(mon, [:flush])
    flush(ref)
  end

  defp close(_), do: :ok

  defp flush(ref) do
    receive do
      {^ref, _} -> flush(ref)
    after
      0 -> :ok
    end
  end
end
