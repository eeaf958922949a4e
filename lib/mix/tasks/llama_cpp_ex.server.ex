defmodule Mix.Tasks.LlamaCppEx.Server do
  @shortdoc "Serves a model over the OpenAI HTTP API"
  @moduledoc """
  Serves a model over the OpenAI HTTP API (`LlamaCppEx.HTTPServer`), like `llama-server`.

      mix llama_cpp_ex.server --model PATH [--port 8080] [--host 127.0.0.1]
      mix llama_cpp_ex.server --hf-repo REPO --hf-file FILE ...

  Options: `--model` (a GGUF file or a Hugging Face checkpoint directory), `--hf-repo` and
  `--hf-file` (downloaded through `LlamaCppEx.Hub` instead), `--port` (8080), `--host`
  (127.0.0.1), `--api-key` (required as `Authorization: Bearer` when given), `--n-parallel`
  (4), `--ctx-size` (the Server's default), `--alias` (the model name clients see; default the
  file's name), `--embeddings-model` (another model for `/v1/embeddings`).

  Several machines (`LlamaCppEx.Cluster`): `--cluster NAME` makes the model's server a replica
  of the group `NAME` and routes every HTTP request over the whole group; without a model the
  node only routes. `--connect NODE` (repeatable) connects to other nodes first. Start the VM
  distributed:

      elixir --name a@10.0.0.5 --cookie $COOKIE -S mix llama_cpp_ex.server --model PATH --cluster smollm2
      elixir --name r@10.0.0.7 --cookie $COOKIE -S mix llama_cpp_ex.server --cluster smollm2 \\
        --connect a@10.0.0.5 --host 0.0.0.0

  Prints the URL once the model is loaded; stops cleanly on SIGTERM or Ctrl-C.
  """
  use Mix.Task

  @switches [
    model: :string,
    hf_repo: :string,
    hf_file: :string,
    port: :integer,
    host: :string,
    api_key: :string,
    n_parallel: :integer,
    ctx_size: :integer,
    alias: :string,
    embeddings_model: :string,
    cluster: :string,
    connect: :keep
  ]

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: @switches)
    Mix.Task.run("app.start")
    group = if name = opts[:cluster], do: String.to_atom(name)

    for node <- Keyword.get_values(opts, :connect),
        not Node.connect(String.to_atom(node)),
        do: Mix.raise("cannot connect to #{node} (is this VM started with --name or --sname?)")

    if group && opts[:embeddings_model],
      do: Mix.raise("--embeddings-model cannot be combined with --cluster")

    path = model_path(opts, group)

    server =
      if path do
        server_opts =
          [model_path: path, n_parallel: opts[:n_parallel] || 4, cluster: group] ++
            if(opts[:ctx_size], do: [n_ctx: opts[:ctx_size]], else: [])

        {:ok, server} = LlamaCppEx.Server.start_link(server_opts)
        {:ok, _model} = wait(server)
        server
      end

    embeddings =
      if e = opts[:embeddings_model] do
        {:ok, s} = LlamaCppEx.Server.start_link(model_path: e, n_parallel: 1)
        {:ok, _} = wait(s)
        s
      end

    {:ok, ip} = :inet.parse_address(String.to_charlist(opts[:host] || "127.0.0.1"))

    {:ok, http} =
      LlamaCppEx.HTTPServer.start_link(
        [
          embeddings: embeddings,
          port: opts[:port] || 8080,
          ip: ip,
          api_key: opts[:api_key],
          model_name: opts[:alias] || Path.basename(path || to_string(group))
        ] ++ if(group, do: [cluster: group], else: [server: server])
      )

    host = opts[:host] || "127.0.0.1"
    what = if group, do: "the group #{group}#{if path, do: " (with #{path})"}", else: path

    Mix.shell().info(
      "LlamaCppEx: serving #{what} at http://#{host}:#{LlamaCppEx.HTTPServer.port(http)}/v1"
    )

    me = self()
    System.trap_signal(:sigterm, fn -> send(me, :stop) && :ok end)

    receive do
      :stop ->
        # no new connections, then the model's server; requests in flight end with it
        GenServer.stop(http)
        if embeddings, do: GenServer.stop(embeddings)
        if server, do: GenServer.stop(server)
        Mix.shell().info("LlamaCppEx: stopped")
        System.halt(0)
    end
  end

  defp model_path(opts, group) do
    cond do
      opts[:model] ->
        opts[:model]

      opts[:hf_repo] && opts[:hf_file] ->
        case LlamaCppEx.Hub.download(opts[:hf_repo], opts[:hf_file]) do
          {:ok, path} -> path
          {:error, reason} -> Mix.raise("cannot download the model: #{reason}")
        end

      group != nil ->
        nil

      true ->
        Mix.raise("give --model PATH, or --hf-repo REPO --hf-file FILE")
    end
  end

  defp wait(server, tries \\ 600) do
    case LlamaCppEx.Server.fetch_model(server) do
      {:ok, m} -> {:ok, m}
      _ when tries > 0 -> Process.sleep(100) && wait(server, tries - 1)
      other -> Mix.raise("the model did not load: #{inspect(other)}")
    end
  end
end
