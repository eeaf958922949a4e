defmodule LlamaCppEx.ClusterTest do
  # Server replicas on real BEAM nodes (OTP's :peer on 127.0.0.1), each serving SmolLM2, and
  # LlamaCppEx.Cluster routing to them.
  use ExUnit.Case, async: false
  import LlamaCppEx.Eventually, only: [wait_until: 1]

  alias LlamaCppEx.{CLI, Cluster, HTTPServer, JSON, Peers, Server, TestModels}
  alias LlamaCppEx.Cluster.Router

  @moduletag timeout: 600_000
  @group :cluster_test_smollm2
  @server_opts [n_parallel: 2, n_ctx: 2048, n_threads: 1, temp: 0.0]

  setup_all do
    Peers.ensure_distributed!()
    opts = [model_path: TestModels.smollm2_path(), cluster: @group] ++ @server_opts
    {:ok, local} = Server.start_link(opts)
    {:ok, _} = TestModels.wait_model(local)
    {_, node_a} = Peers.start!(:replica_a)
    {_, node_b} = Peers.start!(:replica_b)
    a = Peers.start_server!(node_a, opts)
    b = Peers.start_server!(node_b, opts)
    wait_until(fn -> length(Cluster.replicas(@group)) == 3 end)
    on_exit(fn -> Process.exit(local, :normal) end)
    %{local: local, a: a, b: b, replicas: [local, a, b]}
  end

  # every replica idle, as the last test left them, once its load signal arrives here
  defp wait_idle,
    do: wait_until(fn -> Enum.all?(Cluster.replicas(@group), &(&1.free_slots == 2)) end)

  defp stats(pids), do: Map.new(pids, &{&1, Server.get_stats(&1)})

  # every replica idle, each slot holding exactly the blocks its cached tokens need
  defp assert_clean(pids) do
    for pid <- pids do
      {:ok, audit} = Server.kv_audit(pid)

      for {seq, blocks} <- List.first(audit.owners),
          do: assert(blocks == div(audit.cached_tokens[seq] + 15, 16))

      assert Server.get_stats(pid).active_slots == 0
    end
  end

  test "replicas/1 lists every replica with its published load", %{replicas: pids} do
    wait_idle()
    replicas = Cluster.replicas(@group)
    assert Enum.sort(Enum.map(replicas, & &1.pid)) == Enum.sort(pids)
    assert length(Enum.uniq(Enum.map(replicas, & &1.node))) == 3

    for r <- replicas do
      assert %{free_slots: 2, queue_depth: 0, model: "SmolLM2-135M-Instruct.Q4_1.gguf"} = r
      assert r.kv_free_tokens > 0
    end
  end

  test "every route gives the local Server's greedy text", %{local: local, a: a, b: b} do
    prompt = "The capital of France is"
    {:ok, want} = Server.generate(local, prompt, max_tokens: 16)

    for pid <- [a, b] do
      assert Cluster.generate(@group, prompt, max_tokens: 16, replica: pid) == {:ok, want}
      assert Enum.join(Cluster.stream(@group, prompt, max_tokens: 16, replica: pid)) == want
    end

    messages = [%{role: "user", content: "Name a color."}]
    {:ok, chat} = Server.chat(local, messages, max_tokens: 12)
    assert Cluster.chat(@group, messages, max_tokens: 12, replica: a) == {:ok, chat}
    assert Enum.join(Cluster.stream_chat(@group, messages, max_tokens: 12, replica: b)) == chat

    {:ok, completion} = Cluster.chat_completion(@group, messages, max_tokens: 12, replica: b)
    assert hd(completion.choices).message.content == chat

    chunks = Enum.to_list(Cluster.stream_chat_completion(@group, messages, max_tokens: 12))
    assert Enum.map_join(chunks, &(hd(&1.choices).delta[:content] || "")) == chat

    {:ok, [want_vec]} = Server.embed(local, ["cats purr"])
    assert {:ok, [got]} = Cluster.embed(@group, ["cats purr"])
    assert got == want_vec
  end

  test "without a key, load spreads over the replicas", %{replicas: pids} do
    wait_idle()
    before = stats(pids)

    1..6
    |> Task.async_stream(
      &Cluster.generate(@group, "Story #{&1}:", max_tokens: 24, route: :least_loaded),
      timeout: 120_000,
      max_concurrency: 6
    )
    |> Enum.each(fn {:ok, result} -> assert {:ok, _} = result end)

    after_ = stats(pids)

    for pid <- pids,
        do: assert(after_[pid].requests_completed > before[pid].requests_completed)
  end

  test "a conversation's turns stay on one replica and hit its prefix cache", %{replicas: pids} do
    system = %{role: "system", content: "You are a terse assistant who answers in one line."}
    before = stats(pids)

    Enum.reduce(1..3, [system], fn i, history ->
      history = history ++ [%{role: "user", content: "Question #{i}: name #{i} fruits."}]
      assert {:ok, answer} = Cluster.chat(@group, history, max_tokens: 16)
      history ++ [%{role: "assistant", content: answer}]
    end)

    after_ = stats(pids)
    served = Enum.filter(pids, &(after_[&1].requests_completed > before[&1].requests_completed))
    assert [replica] = served
    assert after_[replica].requests_completed - before[replica].requests_completed == 3
    # turns 2 and 3 reuse the history the earlier turns left in the cache
    assert after_[replica].prefix_cache_tokens - before[replica].prefix_cache_tokens > 40

    # the same :session, with unrelated prompts
    before = stats(pids)
    for i <- 1..3, do: {:ok, _} = Cluster.generate(@group, "Tell me #{i}", session: :alice)
    after_ = stats(pids)
    served = Enum.filter(pids, &(after_[&1].requests_completed > before[&1].requests_completed))
    assert [_one] = served
  end

  test "a caller that dies or halts its stream frees the remote slot", %{a: a, replicas: pids} do
    parent = self()
    before = Server.get_stats(a).tokens_generated

    caller =
      spawn(fn ->
        @group
        |> Cluster.stream("Tell a long story.", max_tokens: 2000, replica: a)
        |> Enum.each(fn _ -> send(parent, :streaming) end)
      end)

    assert_receive :streaming, 30_000
    Process.exit(caller, :kill)
    wait_until(fn -> Server.get_stats(a).active_slots == 0 end)
    assert Server.get_stats(a).tokens_generated - before < 2000

    taken =
      @group |> Cluster.stream("Tell a long story.", max_tokens: 2000, replica: a) |> Enum.take(3)

    assert length(taken) == 3
    wait_until(fn -> Server.get_stats(a).active_slots == 0 end)
    assert Server.get_stats(a).tokens_generated - before < 4000
    assert_clean(pids)
  end

  test "a replica's node going down: in-flight requests fail, unstarted ones retry", %{
    replicas: pids
  } do
    {_, node_c} = Peers.start!(:replica_c)
    opts = [model_path: TestModels.smollm2_path(), cluster: @group] ++ @server_opts
    c = Peers.start_server!(node_c, opts)
    wait_until(fn -> c in Enum.map(Cluster.replicas(@group), & &1.pid) end)

    # mid-stream: the stream ends with {:error, :replica_down}
    Node.monitor(node_c, true)

    elements =
      @group
      |> Cluster.stream("Tell a long story.", max_tokens: 2000, replica: c)
      |> Enum.reduce([], fn
        e, [] ->
          :erpc.cast(node_c, :erlang, :halt, [])
          [e]

        e, acc ->
          [e | acc]
      end)

    assert hd(elements) == {:error, :replica_down}
    assert length(elements) < 2000
    assert_receive {:nodedown, ^node_c}, 5_000
    assert {:ok, _} = Cluster.generate(@group, "Hello", max_tokens: 4)
    refute c in Enum.map(Cluster.replicas(@group), & &1.pid)

    # a replica that is gone before it accepts the request: hold this node's :pg scope so that
    # the group still lists it, and send a request whose key ranks it first
    {_, node_d} = Peers.start!(:replica_d)
    d = Peers.start_server!(node_d, opts)
    Node.monitor(node_d, true)
    wait_until(fn -> d in Enum.map(Cluster.replicas(@group), & &1.pid) end)
    members = [d | pids]

    session =
      Enum.find(1..10_000, fn s ->
        candidates = Enum.map(members, &{&1, nil, 0})
        hd(Router.order(candidates, :affinity, {:session, s}, %{})) == d
      end)

    scope = Process.whereis(Cluster.scope())
    :sys.suspend(scope)

    try do
      :erpc.cast(node_d, :erlang, :halt, [])
      assert_receive {:nodedown, ^node_d}, 5_000
      assert d in :pg.get_members(Cluster.scope(), @group)
      assert {:ok, _} = Cluster.generate(@group, "Hello", max_tokens: 4, session: session)
    after
      :sys.resume(scope)
    end

    wait_until(fn -> length(Cluster.replicas(@group)) == 3 end)
    assert_clean(pids)
  end

  test "the HTTP server routes through a group", %{local: local} do
    {:ok, http} = HTTPServer.start_link(cluster: @group, port: 0)
    {:ok, empty} = HTTPServer.start_link(cluster: :no_such_group, port: 0)
    url = "http://127.0.0.1:#{HTTPServer.port(http)}"

    post = fn url, body ->
      System.cmd("curl", ["-s", "-H", "content-type: application/json", "-d", body, url])
    end

    chat =
      ~s({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0})

    {out, 0} = post.(url <> "/v1/chat/completions", chat)
    assert %{"choices" => [%{"message" => %{"content" => text}}]} = decode(out)

    assert {:ok, ^text} = Server.chat(local, [%{role: "user", content: "Hi"}], max_tokens: 6)

    stream = String.replace(chat, ~s("max_tokens"), ~s("stream": true, "max_tokens"))
    {out, 0} = post.(url <> "/v1/chat/completions", stream)
    assert out =~ "data: [DONE]"

    {metrics, 0} = System.cmd("curl", ["-s", url <> "/metrics"])
    assert metrics =~ "llamacppex_slots 6"

    {out, 0} = post.("http://127.0.0.1:#{HTTPServer.port(empty)}/v1/chat/completions", chat)
    assert %{"error" => %{"code" => "unavailable"}} = decode(out)
    GenServer.stop(http)
    GenServer.stop(empty)
  end

  defp decode(text) do
    {:ok, map} = JSON.decode(text)
    map
  end

  test "mix llama_cpp_ex.server --cluster: a replica on its own VM, reached over the group" do
    name = "cli_#{System.unique_integer([:positive])}@127.0.0.1"

    port =
      Port.open({:spawn_executable, System.find_executable("elixir")}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: ~w(--name #{name} --cookie #{Node.get_cookie()} -S mix llama_cpp_ex.server
             --model #{TestModels.smollm2_path()} --cluster cli_group --port 0 --n-parallel 1
             --connect #{node()}),
        env: [{~c"MIX_ENV", ~c"test"}, {~c"LLAMA_CPP_EX_SKIP_NATIVE", ~c"1"}]
      ])

    url = CLI.await_url(port)
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    wait_until(fn -> Cluster.replicas(:cli_group) != [] end)
    assert [%{node: remote}] = Cluster.replicas(:cli_group)
    assert Atom.to_string(remote) == name
    assert {:ok, _} = Cluster.generate(:cli_group, "Hello", max_tokens: 4)

    chat = ~s({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    {out, 0} = System.cmd("curl", ["-s", "-d", chat, url <> "/chat/completions"])
    assert %{"choices" => [_]} = decode(out)

    {_, 0} = System.cmd("kill", ["-TERM", "#{os_pid}"])
    assert_receive {^port, {:exit_status, 0}}, 30_000
  end

  test "bad input", %{local: local} do
    assert Cluster.generate(:no_such_group, "x") == {:error, :no_replicas}
    assert Enum.to_list(Cluster.stream(:no_such_group, "x")) == [{:error, :no_replicas}]
    assert Cluster.generate(@group, "x", replica: self()) == {:error, {:not_a_replica, self()}}
    assert Cluster.join(self(), :other) == {:error, :not_a_server}
    assert Cluster.join(:no_such_name, :other) == {:error, :not_a_server}
    # a Server on another node is reached through the cluster, not directly
    remote = Enum.find(Cluster.replicas(@group), &(&1.node != node())).pid
    assert {:error, {:remote_server, _}} = Server.generate(remote, "x")

    assert_raise ArgumentError, ~r/unknown option: :bogus/, fn ->
      Cluster.generate(@group, "x", bogus: 1)
    end

    assert_raise ArgumentError, ~r/unknown option: :bogus/, fn ->
      Cluster.stream(@group, "x", bogus: 1)
    end

    assert_raise ArgumentError, ~r/unknown :route/, fn ->
      Cluster.generate(@group, "x", route: :nearest)
    end

    # leave and join again
    :ok = Cluster.leave(local, @group)
    refute local in Enum.map(Cluster.replicas(@group), & &1.pid)
    :ok = Cluster.join(local, @group)
    assert local in Enum.map(Cluster.replicas(@group), & &1.pid)
  end
end
