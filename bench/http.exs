# The HTTP path's cost: the same greedy chat streams (1 and 8 at once) through the in-VM
# Server (`LlamaCppEx.stream_chat_completion/3`), through `LlamaCppEx.HTTPServer` (SSE over
# loopback, read by a plain socket client), and, with LLAMA_SERVER set, through llama-server
# on the same file (`-np 8 -c 8192`, the same client). Prints TTFT p50/p99, ITL p50/p99 and
# aggregate tokens per second for each.
#
#   ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" \
#   LLAMA_MODEL_PATH=path/to/model.gguf [LLAMA_THREADS=2] [LLAMA_SERVER=/path/to/llama-server] \
#     mix run bench/http.exs

Code.require_file("support/llama_cpp.exs", __DIR__)

alias LlamaCppEx.{HTTPServer, JSON, Server}

defmodule Bench.HTTP do
  @max_tokens 128
  @messages [%{"role" => "user", "content" => "Write a short story about a lighthouse keeper."}]

  def pct(xs, p) do
    s = Enum.sort(xs)
    Enum.at(s, min(length(s) - 1, round(p * (length(s) - 1))))
  end

  # one stream's event times in ms from its start: [first content, ...]
  def in_vm(server) do
    t0 = System.monotonic_time(:microsecond)

    server
    |> LlamaCppEx.stream_chat_completion(@messages, max_tokens: @max_tokens, temp: 0.0)
    |> Enum.flat_map(fn
      %{choices: [%{delta: %{content: c}}]} when c != "" ->
        [(System.monotonic_time(:microsecond) - t0) / 1000]

      _ ->
        []
    end)
  end

  def over_http(port) do
    body =
      JSON.encode!(%{
        "messages" => @messages,
        "max_tokens" => @max_tokens,
        "temperature" => 0,
        "stream" => true
      })

    t0 = System.monotonic_time(:microsecond)
    {:ok, s} = :gen_tcp.connect({127, 0, 0, 1}, port, [:binary, active: false])

    :ok =
      :gen_tcp.send(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" <>
          "connection: close\r\ncontent-length: #{byte_size(body)}\r\n\r\n" <> body
      )

    times = read_events(s, "", t0, [])
    :gen_tcp.close(s)
    times
  end

  defp read_events(s, buf, t0, acc) do
    case :gen_tcp.recv(s, 0, 120_000) do
      {:ok, data} ->
        now = (System.monotonic_time(:microsecond) - t0) / 1000
        buf = buf <> data
        n = length(Regex.scan(~r/"content":"[^"]/, data))

        if String.contains?(buf, "[DONE]"),
          do: Enum.reverse(List.duplicate(now, n) ++ acc),
          else: read_events(s, buf, t0, List.duplicate(now, n) ++ acc)

      {:error, :closed} ->
        Enum.reverse(acc)
    end
  end

  def run(label, streams, fun) do
    t0 = System.monotonic_time(:microsecond)

    results =
      1..streams
      |> Task.async_stream(fn _ -> fun.() end, timeout: :infinity, max_concurrency: streams)
      |> Enum.map(fn {:ok, r} -> r end)

    wall = (System.monotonic_time(:microsecond) - t0) / 1.0e6
    ttft = for [first | _] <- results, do: first

    itl =
      Enum.flat_map(results, fn ts ->
        ts |> Enum.chunk_every(2, 1, :discard) |> Enum.map(fn [a, b] -> b - a end)
      end)

    tokens = Enum.sum(Enum.map(results, &length/1))

    :io.format("~-28s ~2w  ~8.1f ~8.1f  ~7.2f ~7.2f  ~8.1f~n", [
      label,
      streams,
      pct(ttft, 0.5) * 1.0,
      pct(ttft, 0.99) * 1.0,
      pct(itl, 0.5) * 1.0,
      pct(itl, 0.99) * 1.0,
      tokens / wall
    ])
  end
end

path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(
      System.get_env("LLAMA_CPP_EX_MODELS") || Path.expand("~/.cache/llama_cpp_ex/models"),
      "SmolLM2-135M-Instruct.Q4_1.gguf"
    )

threads = String.to_integer(System.get_env("LLAMA_THREADS") || "2")

{:ok, server} =
  Server.start_link(model_path: path, n_parallel: 8, n_ctx: 8192, n_threads: threads)

wait = fn wait ->
  case Server.fetch_model(server) do
    {:ok, _} -> :ok
    _ -> Process.sleep(100) && wait.(wait)
  end
end

wait.(wait)
{:ok, http} = HTTPServer.start_link(server: server, port: 0)
port = HTTPServer.port(http)

IO.puts("model #{Path.basename(path)}, #{threads} threads, #{128} tokens per stream (greedy)")
IO.puts("route                        n  ttft p50 ttft p99  itl p50 itl p99   tok/s")
# warm-up
Bench.HTTP.in_vm(server)

for n <- [1, 8] do
  Bench.HTTP.run("in-VM Server", n, fn -> Bench.HTTP.in_vm(server) end)
  Bench.HTTP.run("LlamaCppEx.HTTPServer", n, fn -> Bench.HTTP.over_http(port) end)
end

if bin = System.get_env("LLAMA_SERVER") do
  # llama-server gets the cores to itself: our servers stop first (run this script with
  # ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" so that idle schedulers
  # sleep instead of spinning next to it)
  GenServer.stop(http)
  GenServer.stop(server)
  lport = 18_000 + :rand.uniform(1000)

  os =
    Port.open({:spawn_executable, bin}, [
      :binary,
      :exit_status,
      args: ~w(-m #{path} --port #{lport} -np 8 -c 8192 -t #{threads} --jinja --log-disable),
      env: Bench.LlamaCpp.port_env(Path.dirname(bin))
    ])

  ready = fn ready ->
    case System.cmd("curl", ["-sf", "http://127.0.0.1:#{lport}/health"], stderr_to_stdout: true) do
      {_, 0} -> :ok
      _ -> Process.sleep(200) && ready.(ready)
    end
  end

  ready.(ready)
  Bench.HTTP.over_http(lport)

  for n <- [1, 8] do
    Bench.HTTP.run("llama-server", n, fn -> Bench.HTTP.over_http(lport) end)
  end

  {:os_pid, pid} = Port.info(os, :os_pid)
  System.cmd("kill", ["#{pid}"])
end
