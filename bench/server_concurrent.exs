# Continuous batching under concurrency, and prefix reuse across conversation turns.
#
#   LLAMA_MODEL_PATH=model.gguf [LLAMA_THREADS=2] [LLAMA_CPP_BIN=/path/to/llama.cpp/bin] \
#     mix run bench/server_concurrent.exs
#
# Workload 1: at concurrency 1, 2, 4, 8, 16 (n_parallel = concurrency), each client sends a
# ~100-token prompt and streams 128 new tokens at temperature 0. Prints aggregate tok/s (wall
# time, prefill included) and decode tok/s (after each stream's first token), its scaling over
# one stream, TTFT and inter-token latency percentiles, the engine's eval time per decode tick
# and the average batch size (from tick telemetry). With LLAMA_CPP_BIN, the same workload
# goes to `llama-server -np N` on 127.0.0.1 (/completion, streamed, one TCP connection per
# request) and our/their ratios are printed; both servers' figures come from the arrival
# times of each token at the client, computed by the same function.
#
# Workload 2: 8 conversations x 4 turns sharing a long system prompt; TTFT with the prompt
# cache off, per slot (kv_unified: false) and across slots, then with a KV budget too small
# for all eight conversations (n_ctx 2048), without and with the level-2 RAM prompt cache
# (prompt_cache_ram_mb: 256). BENCH_LEVELS="" skips workload 1, BENCH_SKIP_PREFIX workload 2,
# BENCH_PREFIX_MODES picks modes (e.g. "small_kv,small_kv_ram"). BENCH_TELEMETRY=0 runs
# without the stand-in `:telemetry` module (as an application without it does; eval p50
# and avg batch then print 0.0). BENCH_OVERLAP=0 starts the servers with `overlap: false`.

alias LlamaCppEx.Server

Code.require_file("support/tele.exs", __DIR__)
Code.require_file("support/llama_cpp.exs", __DIR__)

defmodule Bench.Concurrent do
  def pct([], _), do: 0.0

  def pct(xs, p),
    do: xs |> Enum.sort() |> Enum.at(min(length(xs) - 1, trunc(p / 100 * length(xs))))

  def prompt(i) do
    base =
      "Here is a report on topic #{i}. " <>
        String.duplicate(
          "The committee reviewed the budget, the schedule and the risks in detail. ",
          7
        )

    base <> "Summarize the report:"
  end

  def run_ours(path, c, threads, max_tokens) do
    {:ok, s} =
      Server.start_link(
        model_path: path,
        n_parallel: c,
        n_ctx: c * 512,
        temp: 0.0,
        n_threads: threads,
        cache_prompt: false,
        overlap: System.get_env("BENCH_OVERLAP") != "0"
      )

    wait(s)
    Server.generate(s, "warm up", max_tokens: 4)
    :persistent_term.put(:bench_telemetry, self())
    Bench.Tele.collect_ticks()
    t0 = System.monotonic_time(:microsecond)

    results =
      1..c
      |> Task.async_stream(
        fn i ->
          start = System.monotonic_time(:microsecond)

          times =
            s
            |> Server.stream(prompt(i), max_tokens: max_tokens, timeout: 120_000)
            |> Enum.map(fn _ -> System.monotonic_time(:microsecond) end)

          {start, times}
        end,
        max_concurrency: c,
        timeout: :infinity
      )
      |> Enum.map(fn {:ok, r} -> r end)

    wall = (System.monotonic_time(:microsecond) - t0) / 1.0e6
    :persistent_term.erase(:bench_telemetry)
    ticks = Bench.Tele.collect_ticks()
    GenServer.stop(s)
    n_ticks = max(length(ticks), 1)
    avg_batch = Enum.sum(for {b, _} <- ticks, do: b) / n_ticks
    # decode ticks only (no prompt tokens): the engine's share of the inter-token latency
    decode_evals = for {b, ms} <- ticks, b <= c, do: ms

    results
    |> summarize(wall)
    |> Map.merge(%{batch: avg_batch, eval50: pct(decode_evals, 50)})
  end

  def wait(s) do
    case Server.fetch_model(s) do
      {:ok, _} -> :ok
      _ -> Process.sleep(50) && wait(s)
    end
  end

  # ---- llama-server

  def run_theirs(bin, path, c, threads, max_tokens) do
    port = 18_000 + c
    exe = Path.join(bin, "llama-server")

    server =
      Port.open({:spawn_executable, exe}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: [
          "-m",
          path,
          "-np",
          "#{c}",
          "-c",
          "#{c * 512}",
          "-t",
          "#{threads}",
          "--host",
          "127.0.0.1",
          "--port",
          "#{port}",
          "-cb",
          "--no-webui"
        ],
        env: Bench.LlamaCpp.port_env(bin)
      ])

    with {:error, why} <- wait_http(server, port, 200) do
      raise "llama-server (#{exe}) did not start (#{inspect(why)}); its last output:\n" <>
              port_output(server, "")
    end

    stream_theirs(port, "warm up", 4)
    t0 = System.monotonic_time(:microsecond)

    results =
      1..c
      |> Task.async_stream(
        fn i ->
          start = System.monotonic_time(:microsecond)
          {start, stream_theirs(port, prompt(i), max_tokens)}
        end,
        max_concurrency: c,
        timeout: :infinity
      )
      |> Enum.map(fn {:ok, r} -> r end)

    wall = (System.monotonic_time(:microsecond) - t0) / 1.0e6
    {:os_pid, os_pid} = Port.info(server, :os_pid)
    System.cmd("kill", ["#{os_pid}"])
    summarize(results, wall)
  end

  # The same figures from both servers, taken at the client from each token's arrival:
  # `results` is a list of `{request_start, [token_arrival_time]}` in microseconds.
  def summarize(results, wall) do
    tokens = Enum.sum(for {_, ts} <- results, do: length(ts))
    ttft = for {st, [first | _]} <- results, do: (first - st) / 1000

    itl =
      Enum.flat_map(results, fn {_, ts} ->
        ts |> Enum.chunk_every(2, 1, :discard) |> Enum.map(fn [a, b] -> (b - a) / 1000 end)
      end)

    # decode throughput: tokens after each stream's first, over the span in which streams
    # were decoding (first token of the earliest to last token of the latest)
    firsts = for {_, [first | _]} <- results, do: first
    lasts = for {_, ts} <- results, ts != [], do: List.last(ts)
    span = max(Enum.max(lasts) - Enum.min(firsts), 1) / 1.0e6

    # all streams decoding at once: from the latest first token to the earliest last token
    # (the prompts of streams that arrived a tick later are prefilled inside `span`)
    {t_all, t_end} = {Enum.max(firsts), Enum.min(lasts)}

    together =
      for {_, ts} <- results, t <- ts, t > t_all and t <= t_end, reduce: 0, do: (n -> n + 1)

    %{
      tps: tokens / wall,
      decode_tps: (tokens - length(firsts)) / span,
      all_tps: if(t_end > t_all, do: together / ((t_end - t_all) / 1.0e6), else: 0.0),
      ttft50: pct(ttft, 50),
      ttft99: pct(ttft, 99),
      itl50: pct(itl, 50),
      itl99: pct(itl, 99),
      tokens: tokens
    }
  end

  defp wait_http(_server, _port, 0), do: {:error, :no_answer_on_its_port}

  defp wait_http(server, port, n) do
    case :httpc.request(:get, {~c"http://127.0.0.1:#{port}/health", []}, [timeout: 1000], []) do
      {:ok, {{_, 200, _}, _, _}} ->
        :ok

      _ ->
        receive do
          {^server, {:exit_status, status}} -> {:error, {:exited, status}}
        after
          250 -> wait_http(server, port, n - 1)
        end
    end
  end

  # What the exited (or silent) server printed, its exit status last: a build for another
  # CPU dies with SIGILL (status 132) before it listens.
  defp port_output(server, acc) do
    receive do
      {^server, {:data, data}} ->
        port_output(server, acc <> data)

      {^server, {:exit_status, status}} ->
        String.slice(acc, -2000..-1//1) <> "\nexit status #{status}"
    after
      0 -> String.slice(acc, -2000..-1//1)
    end
  end

  # One /completion request streamed over a plain TCP connection (no client-side connection
  # pool: `:httpc`'s default profile keeps two connections per host, which had queued the
  # requests of higher concurrency levels behind each other); returns the arrival time of
  # each token's server-sent event.
  def stream_theirs(port, prompt, n) do
    body =
      ~s({"prompt": #{inspect(prompt)}, "n_predict": #{n}, "temperature": 0, "cache_prompt": false, "ignore_eos": true, "stream": true})

    {:ok, sock} = :gen_tcp.connect(~c"127.0.0.1", port, [:binary, active: false], 5000)

    :ok =
      :gen_tcp.send(
        sock,
        "POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" <>
          "Connection: close\r\nContent-Length: #{byte_size(body)}\r\n\r\n" <> body
      )

    times = read_events(sock, "", [])
    :gen_tcp.close(sock)
    times
  end

  # events are "data: {...}\n\n"; a token's event says "stop":false, the closing one true
  defp read_events(sock, buf, acc) do
    case :gen_tcp.recv(sock, 0, 600_000) do
      {:ok, data} ->
        now = System.monotonic_time(:microsecond)
        [rest | done] = (buf <> data) |> String.split("\n\n") |> Enum.reverse()
        tokens = Enum.count(done, &(&1 =~ ~r/data: .*"stop":\s*false/))
        read_events(sock, rest, List.duplicate(now, tokens) ++ acc)

      {:error, :closed} ->
        Enum.reverse(acc)
    end
  end
end

defmodule Bench.Prefix do
  def run(path, threads, mode) do
    opts =
      case mode do
        :off -> [cache_prompt: false]
        :per_slot -> [kv_unified: false]
        :cross_slot -> []
        # a KV budget that holds the 4 active conversations but not all 8
        :small_kv -> [n_ctx: 2048]
        :small_kv_ram -> [n_ctx: 2048, prompt_cache_ram_mb: 256]
      end

    base = [model_path: path, n_parallel: 4, n_ctx: 8192, temp: 0.0, n_threads: threads]
    {:ok, s} = Server.start_link(Keyword.merge(base, opts))

    Bench.Concurrent.wait(s)

    system =
      "You are a meticulous assistant for a logistics company. " <>
        String.duplicate(
          "Always answer with precise figures, cite the relevant policy section, and keep a friendly tone. ",
          12
        )

    ttfts =
      1..8
      |> Task.async_stream(
        fn conv ->
          Enum.reduce(1..4, {system, []}, fn turn, {history, acc} ->
            prompt =
              history <>
                "\nUser: conversation #{conv}, question #{turn}: where is parcel #{conv * 10 + turn}?\nAssistant:"

            start = System.monotonic_time(:microsecond)

            [first | rest] =
              s
              |> Server.stream(prompt, max_tokens: 24, session: "conv-#{conv}", timeout: 120_000)
              |> Enum.to_list()

            ttft = (System.monotonic_time(:microsecond) - start) / 1000
            # time to first token is measured on the first chunk's arrival
            _ = rest
            {prompt <> first <> Enum.join(rest), [ttft | acc]}
          end)
          |> elem(1)
        end,
        max_concurrency: 8,
        timeout: :infinity
      )
      |> Enum.flat_map(fn {:ok, t} -> t end)

    stats = Server.get_stats(s)
    GenServer.stop(s)
    {Bench.Concurrent.pct(ttfts, 50), Bench.Concurrent.pct(ttfts, 95), stats.ram_cache_hits}
  end
end

unless System.get_env("BENCH_TELEMETRY") == "0", do: Bench.Tele.install()
:inets.start()

path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(System.user_home!(), ".cache/llama_cpp_ex/models/SmolLM2-135M-Instruct.Q4_1.gguf")

threads = String.to_integer(System.get_env("LLAMA_THREADS") || "#{System.schedulers_online()}")

levels =
  (System.get_env("BENCH_LEVELS") || "1,2,4,8,16")
  |> String.split(",", trim: true)
  |> Enum.map(&String.to_integer/1)

max_tokens = String.to_integer(System.get_env("BENCH_TOKENS") || "128")
bin = System.get_env("LLAMA_CPP_BIN")
f = fn x -> :erlang.float_to_binary(x / 1, decimals: 1) end

IO.puts(
  "model: #{Path.basename(path)}, threads: #{threads}, #{max_tokens} new tokens per request\n"
)

IO.puts("""
tok/s: generated tokens over the wall time (prefill included); decode tok/s: tokens after
each stream's first over the span in which streams were decoding (a prompt that arrived a
tick late is prefilled inside it); all: tokens over the span in which every stream was
decoding (latest first token to earliest last); scaling: decode tok/s over the figure of the
first level (1 stream by default). Both servers' figures are taken at the client.
""")

IO.puts(
  "| conc | tok/s | decode tok/s | all | scaling | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | eval p50 ms | avg batch | llama-server tok/s | decode tok/s | all | ratio tok/s | ratio decode | ratio all | llama-server TTFT p50 | ITL p50 |"
)

IO.puts(
  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)

Enum.reduce(levels, nil, fn c, base ->
  o = Bench.Concurrent.run_ours(path, c, threads, max_tokens)
  t = if bin, do: Bench.Concurrent.run_theirs(bin, path, c, threads, max_tokens)
  base = base || o.decode_tps
  r = fn x, y -> :erlang.float_to_binary(x / y, decimals: 2) end

  theirs =
    if t,
      do:
        "#{f.(t.tps)} | #{f.(t.decode_tps)} | #{f.(t.all_tps)} | #{r.(o.tps, t.tps)} | #{r.(o.decode_tps, t.decode_tps)} | #{r.(o.all_tps, t.all_tps)} | #{f.(t.ttft50)} | #{f.(t.itl50)}",
      else: "- | - | - | - | - | - | - | -"

  if t && t.tokens != c * max_tokens,
    do: IO.puts("(llama-server streamed #{t.tokens} tokens, not #{c * max_tokens})")

  IO.puts(
    "| #{c} | #{f.(o.tps)} | #{f.(o.decode_tps)} | #{f.(o.all_tps)} | #{r.(o.decode_tps, base)} | #{f.(o.ttft50)} | #{f.(o.ttft99)} | #{f.(o.itl50)} | #{f.(o.itl99)} | #{f.(o.eval50)} | #{f.(o.batch)} | #{theirs} |"
  )

  base
end)

unless System.get_env("BENCH_SKIP_PREFIX") do
  IO.puts("\nprefix reuse: 8 conversations x 4 turns, shared system prompt, 24 tokens per turn")
  IO.puts("| cache | n_ctx | TTFT p50 ms | TTFT p95 ms | RAM cache restores |")
  IO.puts("|---|---:|---:|---:|---:|")

  modes =
    (System.get_env("BENCH_PREFIX_MODES") || "off,per_slot,cross_slot,small_kv,small_kv_ram")
    |> String.split(",", trim: true)
    |> Enum.map(&String.to_atom/1)

  for mode <- modes do
    {p50, p95, hits} = Bench.Prefix.run(path, threads, mode)
    n_ctx = if mode in [:small_kv, :small_kv_ram], do: 2048, else: 8192
    IO.puts("| #{mode} | #{n_ctx} | #{f.(p50)} | #{f.(p95)} | #{hits} |")
  end
end
