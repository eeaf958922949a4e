defmodule LlamaCppEx.ModelManager.ModelIO do
  @moduledoc """
  The default `LlamaCppEx.ModelManager.Backend`: files on disk or downloads from the Hub
  (`LlamaCppEx.Hub`), `LlamaCppEx.Model.load/2`, and servers started as temporary children
  of `LlamaCppEx.ModelDynSup`, registered in `LlamaCppEx.ModelRegistry` under their id.
  """

  @behaviour LlamaCppEx.ModelManager.Backend

  alias LlamaCppEx.{Hub, Model, Server}

  @manager_keys [:mode, :capabilities, :default]
  @hub_keys [:cache_dir, :token, :revision, :force, :progress, :verify_checksum, :endpoint]

  @impl true
  @doc "Every option `LlamaCppEx.ModelManager.load/3` accepts with this backend."
  @spec option_keys() :: [atom()]
  def option_keys,
    do: Enum.uniq(@manager_keys ++ @hub_keys ++ Model.option_keys() ++ Server.start_option_keys())

  @doc false
  def manager_keys, do: @manager_keys
  @doc false
  def hub_keys, do: @hub_keys

  def registry, do: LlamaCppEx.ModelRegistry
  def dynamic_supervisor, do: LlamaCppEx.ModelDynSup

  @impl true
  def resolve_source({:path, path}, _opts) when is_binary(path) do
    case File.stat(path) do
      {:ok, %File.Stat{type: :directory}} -> {:ok, path, dir_size(path)}
      {:ok, %File.Stat{size: size}} -> {:ok, path, size}
      {:error, reason} -> {:error, {:stat_failed, path, reason}}
    end
  end

  def resolve_source({:hub, repo, file}, opts) do
    with {:ok, path} <- Hub.download(repo, file, Keyword.take(opts, @hub_keys)) do
      resolve_source({:path, path}, opts)
    end
  end

  def resolve_source(other, _opts),
    do:
      {:error,
       "unknown model source #{inspect(other)}, expected {:path, p} or {:hub, repo, file}"}

  defp dir_size(dir) do
    dir
    |> File.ls!()
    |> Enum.filter(&String.ends_with?(&1, ".safetensors"))
    |> Enum.map(&File.stat!(Path.join(dir, &1)).size)
    |> Enum.sum()
  end

  @impl true
  def load_model(path, opts) do
    validate!(opts)
    Model.load(path, Keyword.take(opts, Model.option_keys()))
  end

  @impl true
  def start_server(id, path, opts) do
    validate!(opts)

    server_opts =
      opts
      |> Keyword.take(Server.start_option_keys())
      |> Keyword.drop(@manager_keys ++ @hub_keys ++ [:vocab_only])
      |> Keyword.put(:model_path, path)
      |> Keyword.put(:name, {:via, Registry, {registry(), id}})

    spec = %{
      id: {Server, id},
      start: {Server, :start_link, [server_opts]},
      restart: :temporary
    }

    # the server's own reason, e.g. `{:model_not_found, path}`, as it gave it
    case DynamicSupervisor.start_child(dynamic_supervisor(), spec) do
      {:ok, pid} -> {:ok, pid}
      {:error, reason} -> {:error, reason}
    end
  end

  # every destination takes only its keys, so a typo (`n_paralell`) would otherwise vanish
  defp validate!(opts),
    do: LlamaCppEx.Options.validate!(opts, option_keys(), "LlamaCppEx.ModelManager.load/3")

  @impl true
  def stop_server(pid) do
    # only servers this backend started
    if Process.whereis(dynamic_supervisor()) &&
         Enum.any?(
           DynamicSupervisor.which_children(dynamic_supervisor()),
           &match?({_, ^pid, _, _}, &1)
         ) do
      DynamicSupervisor.terminate_child(dynamic_supervisor(), pid)
    end

    :ok
  end
end
