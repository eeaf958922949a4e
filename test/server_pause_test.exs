defmodule LlamaCppEx.ServerPauseTest do
  # Server.pause/2, resume/1 and :pause_policy.
  use ExUnit.Case, async: false

  alias LlamaCppEx.{Server, TestModels}

  @moduletag timeout: 600_000

  defmodule FlagPolicy do
    @moduledoc false
    @behaviour LlamaCppEx.Server.PausePolicy
    # the level stored under `key` in :persistent_term (a stand-in for a thermal sensor)
    @impl true
    def pause_level(_info, key), do: :persistent_term.get(key, :none)
  end

  defmodule BrokenPolicy do
    @moduledoc false
    def pause_level(_info, _arg), do: raise("sensor unplugged")
  end

  setup_all do
    {server, _model} = TestModels.start_server(n_parallel: 2, n_ctx: 2048, temp: 0.0)
    %{server: server}
  end

  @prompt "Once upon a time, in a lighthouse by the sea, there lived"

  defp stream_pid(server, prompt, opts) do
    parent = self()

    spawn_link(fn ->
      chunks =
        server
        |> Server.stream(prompt, opts)
        |> Enum.map(fn c ->
          send(parent, {:chunk, self(), c})
          c
        end)

      send(parent, {:done, self(), chunks})
    end)
  end

  test "nothing is lost across a full pause; no token arrives while paused", %{server: server} do
    {:ok, want} = Server.generate(server, @prompt, max_tokens: 40, cache_prompt: false)
    pid = stream_pid(server, @prompt, max_tokens: 40, cache_prompt: false)
    assert_receive {:chunk, ^pid, _}, 10_000
    # pause/2 returns after the step in flight: from then on the count of generated tokens
    # holds still (chunks already sent may still be on their way through the stream)
    :ok = Server.pause(server)
    stats = Server.get_stats(server)
    assert stats.paused and stats.pause_level == :full and stats.active_slots == 1
    Process.sleep(400)
    assert Server.get_stats(server).tokens_generated == stats.tokens_generated

    # a request arriving while paused waits too
    other = stream_pid(server, "Name three colours.", max_tokens: 8, cache_prompt: false)
    refute_receive {:chunk, ^other, _}, 200

    :ok = Server.resume(server)
    assert_receive {:done, ^pid, chunks}, 30_000
    assert Enum.join(chunks) == want
    assert_receive {:done, ^other, [_ | _]}, 30_000
    refute Server.get_stats(server).paused
  end

  test "caller timeouts still apply while paused", %{server: server} do
    :ok = Server.pause(server)

    assert [{:error, :timeout}] =
             server |> Server.stream("hello", max_tokens: 4, timeout: 200) |> Enum.to_list()

    assert {:error, :timeout} = Server.embed(server, ["hello"], timeout: 200)
    :ok = Server.resume(server)
    assert {:ok, _} = Server.generate(server, "hello", max_tokens: 4)
    stats = Server.get_stats(server)
    assert stats.active_slots == 0 and stats.queue_depth == 0 and stats.embed_queue_depth == 0
  end

  test "a prefill pause keeps decoding what generates and holds new prompts", %{server: server} do
    {:ok, want} = Server.generate(server, @prompt, max_tokens: 40, cache_prompt: false)
    pid = stream_pid(server, @prompt, max_tokens: 40, cache_prompt: false)
    assert_receive {:chunk, ^pid, _}, 10_000
    :ok = Server.pause(server, :prefill)
    other = stream_pid(server, "Name three colours.", max_tokens: 8, cache_prompt: false)
    # the generating request finishes; the new one has not started
    assert_receive {:done, ^pid, chunks}, 30_000
    assert Enum.join(chunks) == want
    refute_receive {:chunk, ^other, _}, 100
    assert Server.get_stats(server).pause_level == :prefill
    :ok = Server.resume(server)
    assert_receive {:done, ^other, [_ | _]}, 30_000
  end

  test "a pause policy pauses and resumes by itself; paused time leaves tok/s alone" do
    key = {__MODULE__, :level}
    :persistent_term.put(key, :none)
    parent = self()
    id = make_ref()

    :telemetry.attach(
      id,
      [:llama_cpp_ex, :server, :pause],
      fn _, _, meta, _ -> send(parent, {:pause_event, meta.level}) end,
      nil
    )

    on_exit(fn ->
      :telemetry.detach(id)
      :persistent_term.erase(key)
    end)

    {:ok, server} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 1,
        n_ctx: 1024,
        temp: 0.0,
        pause_policy: {FlagPolicy, key},
        pause_poll_ms: 20
      )

    {:ok, _} = TestModels.wait_model(server)
    {:ok, want} = Server.generate(server, @prompt, max_tokens: 30, cache_prompt: false)
    :ok = Server.reset_stats_window(server)
    :persistent_term.put(key, :full)
    pid = stream_pid(server, @prompt, max_tokens: 30, cache_prompt: false)
    assert_receive {:pause_event, :full}, 5_000
    refute_receive {:chunk, ^pid, _}, 500
    assert Server.get_stats(server).paused
    :persistent_term.put(key, :none)
    assert_receive {:pause_event, :none}, 5_000
    assert_receive {:done, ^pid, chunks}, 30_000
    assert Enum.join(chunks) == want

    stats = Server.get_stats(server)
    assert stats.paused_ms >= 500
    active_ms = stats.window_ms - stats.paused_ms
    assert_in_delta stats.tokens_per_second, stats.window_tokens * 1000 / active_ms, 1.0
    assert stats.tokens_per_second > stats.window_tokens * 1000 / stats.window_ms
    GenServer.stop(server)
  end

  test "a policy that raises counts as :none; a bad policy is refused at start" do
    Process.flag(:trap_exit, true)

    assert {:error, {:invalid_pause_policy, String}} =
             Server.start_link(model_path: TestModels.smollm2_path(), pause_policy: String)

    {:ok, server} =
      Server.start_link(
        model_path: TestModels.smollm2_path(),
        n_parallel: 1,
        n_ctx: 512,
        pause_policy: BrokenPolicy
      )

    {:ok, _} = TestModels.wait_model(server)

    {result, log} =
      ExUnit.CaptureLog.with_log(fn -> Server.generate(server, "hi", max_tokens: 3) end)

    assert {:ok, _} = result
    assert log =~ "pause policy"
    GenServer.stop(server)
  end
end
