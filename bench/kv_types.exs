# Decode speed and KV memory per cache type (f16, q8_0, q4_0) on one model, model route:
# a ~500-token prompt, then 128 greedy tokens; median of 3. Then sequences served at once in
# a Server with a fixed KV budget in bytes.
#
#   [LLAMA_MODEL_PATH=model.gguf] [LLAMA_THREADS=2] mix run bench/kv_types.exs

Code.require_file("support/models.exs", __DIR__)
path = Bench.Models.default_path()
threads = String.to_integer(System.get_env("LLAMA_THREADS", "2"))
{:ok, model} = LlamaCppEx.load_model(path)
info = LlamaCppEx.Model.info(model)
prompt = String.duplicate("The committee reviewed the budget, the schedule and the risks. ", 40)
median = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end

run = fn type, max ->
  median.(
    for _ <- 1..3 do
      {us, {:ok, _}} =
        :timer.tc(fn ->
          LlamaCppEx.generate(model, prompt,
            max_tokens: max,
            temp: 0.0,
            n_threads: threads,
            n_ctx: 1024,
            type_k: type,
            type_v: type
          )
        end)

      us / 1000
    end
  )
end

# bytes per cached token: K and V rows of every layer
head_row = div(info.n_embd, info.n_head) * info.n_head_kv
bytes = %{f16: 2.0, q8_0: 34 / 32, q4_0: 18 / 32}

IO.puts("model #{Path.basename(path)}, #{threads} threads")
IO.puts("| KV type | bytes / token | decode ms (128 tok, after a 500-token prompt) | tok/s |")
IO.puts("|---|---:|---:|---:|")

for type <- [:f16, :q8_0, :q4_0] do
  prefill = run.(type, 1)
  total = run.(type, 129)
  decode = total - prefill
  per_token = round(2 * info.n_layer * head_row * bytes[type])

  IO.puts(
    "| #{type} | #{per_token} | #{Float.round(decode, 1)} | #{Float.round(128_000 / decode, 1)} |"
  )
end

# Sequences served concurrently at a fixed KV budget: a Server with kv_budget_mb: 8 and 8
# slots, 8 requests of a ~250-token prompt and 64 new tokens at once; the most requests
# active together (get_stats polled every 10 ms) and the wall time.
alias LlamaCppEx.Server

IO.puts("\n| KV type (8 MiB budget) | n_ctx | most active at once | wall s |")
IO.puts("|---|---:|---:|---:|")
long = String.duplicate("The committee reviewed the budget, the schedule and the risks. ", 20)

for type <- [:f16, :q8_0, :q4_0] do
  {s, _} =
    Bench.Models.start_server(path,
      n_threads: threads,
      n_parallel: 8,
      kv_budget_mb: 8,
      type_k: type,
      type_v: type
    )

  parent = self()

  poller =
    spawn(fn ->
      loop = fn loop, best ->
        receive do
          :stop -> send(parent, {:best, best})
        after
          10 -> loop.(loop, max(best, Server.get_stats(s).active_slots))
        end
      end

      loop.(loop, 0)
    end)

  {us, _} =
    :timer.tc(fn ->
      1..8
      |> Enum.map(fn i ->
        Task.async(fn ->
          Server.generate(s, "#{i}. " <> long, max_tokens: 64, timeout: 600_000)
        end)
      end)
      |> Task.await_many(600_000)
    end)

  send(poller, :stop)
  best = receive do: ({:best, b} -> b)
  IO.puts("| #{type} | #{Server.get_stats(s).n_ctx} | #{best} | #{Float.round(us / 1.0e6, 1)} |")
  GenServer.stop(s)
end
